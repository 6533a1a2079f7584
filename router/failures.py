"""What the router does when an attempt fails: retry it elsewhere, recompute it on its decode
instance, or give up; an instance found dead; and the guard around its event handlers (an exception
in one fails only the request it was handling). The router holds one `Failures` over its tables
(router/tables.py). Every method but `mark_dead` runs under the tables' lock; calls to instances are
deferred until it is released.

Failpoints (`Failpoints`): a fault injected into a running gateway's router on purpose, to prove that its
guards fail one request and nothing else (the chaos run's `router_fault`, bench/chaos_faults.py).

    PDSERVE_FAILPOINTS=sigusr2     at start: SIGUSR2 arms the router's failpoint; the next event a
                                   router handler takes (placing a request, a prefill result, a
                                   decode output) raises InjectedFault inside that handler, once
                                   per signal

Unset (the default), nothing is installed and `check` is one integer test. Armed, it is logged at
start; every fault it fires is logged and counted by the guard it hits (handler_errors)."""
from __future__ import annotations

import logging
import os
import signal
import threading

from router.tables import RouterTables, StreamEvent, Tracked

logger = logging.getLogger(__name__)


class Failures:
    """The router's retry policy over its tables (router/tables.py): what ends an attempt, and
    whether the request goes on elsewhere, recomputes, or fails."""

    def __init__(self, tables: RouterTables, max_attempts: int, kv_recompute_max_tokens: int,
                 failpoints: Failpoints):
        self.tables, self.max_attempts = tables, max_attempts
        self.kv_recompute_max_tokens, self.failpoints = kv_recompute_max_tokens, failpoints

    def fail(self, tracked: Tracked, instance_id: str | None, reason: str) -> None:
        logger.warning("request %s attempt %d failed on %s: %s", tracked.request_id, tracked.attempt,
                       instance_id, reason)
        if instance_id is not None:
            tracked.excluded.add(instance_id)
        self.tables.abort_attempt(tracked, "failed", reason)
        if tracked.choices:
            return self.split(tracked, lambda choice: self.fail(choice, instance_id, reason))
        tracked.grouped = False  # a choice goes on by itself
        self.retry(tracked, reason)

    def split(self, parent: Tracked, each) -> None:
        """The placement of an n > 1 request ended before its choices forked: `each` choice goes on
        (or ends) by itself."""
        for choice in parent.choices:
            if not choice.done and choice.grouped:
                each(choice)

    def may_recompute(self, tracked: Tracked) -> bool:
        n = len(tracked.prompt_token_ids) + len(tracked.delivered)
        return n <= self.kv_recompute_max_tokens and tracked.attempt + 1 < self.max_attempts

    def recompute(self, tracked: Tracked, reason: str) -> None:
        """The decode instance's KV load failed: its next attempt prefills there (prompt and the
        tokens already streamed, as for any retry), no transfer involved."""
        logger.warning("request %s attempt %d: KV load on %s failed (%s); recomputing it there",
                       tracked.request_id, tracked.attempt, tracked.decode_id, reason)
        self.tables.stats["kv_recomputes"] += 1
        decode_id = tracked.decode_id
        self.tables.abort_attempt(tracked, "kv_load_failed", reason)
        if tracked.choices:
            return self.split(tracked, lambda choice: self.recompute(choice, reason))
        tracked.recompute_on, tracked.grouped = decode_id, False
        self.retry(tracked, reason)

    def retry(self, tracked: Tracked, reason: str) -> None:
        """Queues the request's next attempt at the head of the queue (the placement thread
        makes it: the caller holds the lock)."""
        if tracked.attempt + 1 >= self.max_attempts or tracked.done:
            return self.give_up(tracked, reason)
        tracked.attempt += 1
        self.tables.stats["retries"] += 1
        self.tables.pending.push(tracked, ahead=True)
        self.tables.wake.notify_all()

    def give_up(self, tracked: Tracked, reason: str, bad_request: bool = False) -> None:
        self.tables.by_attempt.pop(tracked.attempt_id, None)
        if tracked.choices:
            return self.split(tracked, lambda choice: self.give_up(choice, reason, bad_request))
        self.tables.stats["failed"] += 1
        self.tables.finish(tracked, StreamEvent([], True, "error", reason, bad_request=bad_request))

    # -- the guard: an exception fails only the request it was about ---------------------------------
    def handle_events(self, handler: str, handle, events: list) -> None:
        """Under the lock: each event to `handle`; one that raises fails only its own request (an
        explicit error) and the rest are handled."""
        for event in events:
            tracked = self.tables.by_attempt.get(event.request_id)  # before the handler can change the tables
            try:
                self.failpoints.check(handler)
                handle(event)
            except Exception as exc:
                self.handler_failed(handler, exc, tracked)

    def handler_failed(self, handler: str, exc: Exception, tracked: Tracked | None) -> None:
        """Under the lock: `handler` raised over `tracked`'s request (a bug, or an error no path
        expects). Only that request ends, with an explicit error; counted in `handler_errors`."""
        self.tables.handler_errors[handler] += 1
        rid = None if tracked is None else tracked.request_id
        logger.error("router handler %s raised on request %s; that request fails", handler, rid, exc_info=exc)
        if tracked is not None:
            self.fail_request(tracked, f"internal error in the router ({handler}: {type(exc).__name__})")
        self.tables.wake.notify_all()  # whatever it held may be free now

    def fail_request(self, tracked: Tracked, reason: str) -> None:
        """Under the lock: the whole request `tracked` belongs to (every choice) leaves the queue
        and its instances, and each choice not ended yet ends with an error. Assumes nothing of
        the state a raising handler left: it may have been half updated."""
        root = tracked.parent or tracked
        for t in [root, *root.choices]:
            if t in self.tables.pending:
                self.tables.pending.remove(t)
            if t.done and self.tables.by_attempt.get(t.attempt_id) is not t:
                continue  # a choice that ended: nothing of it runs
            self.tables.by_attempt.pop(t.attempt_id, None)
            for iid in {t.prefill_id, t.decode_id, *t.placing} - {None}:  # placing: any candidate may hold it
                if (client := self.tables.client(iid)) is not None:
                    self.tables.deferred.append((client.abort, t.attempt_id))
            t.placing = ()
        for t in root.choices or [root]:
            if not t.done:
                self.tables.stats["failed"] += 1
                try:
                    self.tables.finish(t, StreamEvent([], True, "error", reason))
                except Exception:  # its consumer's listener raised: it is marked done all the same
                    logger.exception("request %s: cannot deliver its end", t.request_id)
        root.done = True
        if self.tables.live.get(root.request_id) is root:
            del self.tables.live[root.request_id]

    def leave(self, iid: str) -> None:
        """An instance leaves (removed, or flipping to another role): what still needs it is retried
        elsewhere, as for a dead one (logged and counted so); a drained one just stops being used."""
        with self.tables.locked():
            client = self.tables.client(iid)
            busy = any(t.decode_id == iid or (t.prefill_id == iid and not t.decoding) or iid in t.placing
                       for t in self.tables.by_attempt.values())  # (as Router.is_drained)
            if client is not None and not busy:
                client.info.healthy = False
                return
        self.mark_dead(iid, RuntimeError("removed"))

    def mark_dead(self, iid: str, exc: Exception | None = None) -> None:
        """An instance died (found by this router's calls, or told by its owner): every attempt
        on it is retried elsewhere."""
        with self.tables.locked():
            client = self.tables.client(iid)
            if client is None or not client.info.healthy:
                return
            client.info.healthy = False
            self.tables.stats["instance_deaths"] += 1
            logger.error("instance %s is dead (%s); retrying its requests", iid, exc)
            for tracked in [t for t in self.tables.by_attempt.values() if iid in (t.prefill_id, t.decode_id)]:
                if self.tables.by_attempt.get(tracked.attempt_id) is not tracked:
                    continue  # a choice its parent's failure already sent on
                if tracked.prefill_id == iid and tracked.decoding and tracked.num_attempt_tokens:
                    tracked.prefill_id = None  # its KV and first token are out already: it goes on there
                    continue
                self.fail(tracked, iid, f"instance {iid} died")


ENV = "PDSERVE_FAILPOINTS"


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint."""


class Failpoints:
    def __init__(self):
        self.armed = 0  # faults still to fire
        self.fired = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Failpoints:
        """Installs the SIGUSR2 trigger when ENV asks for it (from the main thread: elsewhere
        Python refuses a signal handler, and this says so)."""
        points = cls()
        mode = os.environ.get(ENV, "")
        if mode == "sigusr2":
            try:
                signal.signal(signal.SIGUSR2, lambda *_: points.arm())
                logger.warning("%s=sigusr2: SIGUSR2 makes the next router handler raise (fault injection)", ENV)
            except ValueError:  # not the main thread
                logger.warning("%s=sigusr2 ignored: the router was not built on the main thread", ENV)
        elif mode:
            raise ValueError(f"{ENV}={mode!r}: the one mode is 'sigusr2'")
        return points

    def arm(self, times: int = 1) -> None:
        with self._lock:
            self.armed += times

    def check(self, where: str) -> None:
        """Raises InjectedFault once per arming; nothing when unarmed."""
        if not self.armed:
            return
        with self._lock:
            if not self.armed:
                return
            self.armed -= 1
            self.fired += 1
        logger.warning("failpoint fired in router handler %s", where)
        raise InjectedFault(f"injected fault in {where}")
