"""What the router does when an attempt fails: retry it elsewhere, recompute it on its decode
instance, or give up; and an instance found dead. Every method runs under the router's lock
(router/router.py); calls to instances are deferred until it is released."""
from __future__ import annotations

import logging

from router.client import InstanceDeadError
from router.stream import StreamEvent, Tracked

logger = logging.getLogger(__name__)


class Failures:
    """Router's failure paths (a mixin of Router: its tables, stats and lock)."""

    def _fail(self, tracked: Tracked, instance_id: str | None, reason: str) -> None:
        logger.warning("request %s attempt %d failed on %s: %s", tracked.request_id, tracked.attempt,
                       instance_id, reason)
        if instance_id is not None:
            tracked.excluded.add(instance_id)
        self._abort_attempt(tracked)
        if tracked.choices:
            return self._split(tracked, lambda choice: self._fail(choice, instance_id, reason))
        tracked.grouped = False  # a choice goes on by itself
        self._retry(tracked, reason)

    def _split(self, parent: Tracked, each) -> None:
        """The placement of an n > 1 request ended before its choices forked: `each` choice goes on
        (or ends) by itself."""
        for choice in parent.choices:
            if not choice.done and choice.grouped:
                each(choice)

    def _may_recompute(self, tracked: Tracked) -> bool:
        n = len(tracked.prompt_token_ids) + len(tracked.delivered)
        return n <= self.kv_recompute_max_tokens and tracked.attempt + 1 < self.max_attempts

    def _recompute(self, tracked: Tracked, reason: str) -> None:
        """The decode instance's KV load failed: its next attempt prefills there (prompt and the
        tokens already streamed, as for any retry), no transfer involved."""
        logger.warning("request %s attempt %d: KV load on %s failed (%s); recomputing it there",
                       tracked.request_id, tracked.attempt, tracked.decode_id, reason)
        self.stats["kv_recomputes"] += 1
        decode_id = tracked.decode_id
        self._abort_attempt(tracked)
        if tracked.choices:
            return self._split(tracked, lambda choice: self._recompute(choice, reason))
        tracked.recompute_on, tracked.grouped = decode_id, False
        self._retry(tracked, reason)

    def _retry(self, tracked: Tracked, reason: str) -> None:
        """Queues the request's next attempt at the head of the queue (the placement thread
        makes it: the caller holds the lock)."""
        if tracked.attempt + 1 >= self.max_attempts or tracked.done:
            return self._give_up(tracked, reason)
        tracked.attempt += 1
        self.stats["retries"] += 1
        self._pending.appendleft(tracked)
        self._wake.notify_all()

    def _give_up(self, tracked: Tracked, reason: str, bad_request: bool = False) -> None:
        self._by_attempt.pop(tracked.attempt_id, None)
        if tracked.choices:
            return self._split(tracked, lambda choice: self._give_up(choice, reason, bad_request))
        self.stats["failed"] += 1
        self._finish(tracked, StreamEvent([], True, "error", reason, bad_request=bad_request))

    def _abort_attempt(self, tracked: Tracked) -> None:
        """Under the lock: forgets the attempt; its instances are told once the lock is released."""
        self._by_attempt.pop(tracked.attempt_id, None)
        for iid in (tracked.prefill_id, tracked.decode_id):
            client = self._client(iid) if iid is not None else None
            if client is not None:
                self._deferred.append((client.abort, tracked.attempt_id))

    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except InstanceDeadError:
            pass

    def mark_dead(self, iid: str, exc: Exception | None = None) -> None:
        """An instance died (found by this router's calls, or told by its owner): every attempt
        on it is retried elsewhere."""
        with self._locked():
            client = self._client(iid)
            if client is None or not client.info.healthy:
                return
            client.info.healthy = False
            self.stats["instance_deaths"] += 1
            logger.error("instance %s is dead (%s); retrying its requests", iid, exc)
            for tracked in [t for t in self._by_attempt.values() if iid in (t.prefill_id, t.decode_id)]:
                if self._by_attempt.get(tracked.attempt_id) is not tracked:
                    continue  # a choice its parent's failure already sent on
                if tracked.prefill_id == iid and tracked.decoding and tracked.num_attempt_tokens:
                    tracked.prefill_id = None  # its KV and first token are out already: it goes on there
                    continue
                self._fail(tracked, iid, f"instance {iid} died")
