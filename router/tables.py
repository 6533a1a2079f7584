"""The router's tables and their lock: what the router (router/router.py) and its failure policy
(router/failures.py) both read and change. Everything here is guarded by `lock`; calls to instances
wanted under it (aborts) go to `deferred` and run once the outermost holder releases it."""
from __future__ import annotations

import logging
import threading
from collections import deque
from contextlib import contextmanager

from router.client import DecodeClient, InstanceDeadError, PrefillClient
from router.stream import StreamEvent, Tracked

logger = logging.getLogger(__name__)

# what a guard catches an exception in (the label of pdserve_router_handler_errors_total)
HANDLERS = ("place", "prefill_result", "decode_output", "deferred", "load")
# cumulative counters (the autoscaler's arrival rate and request shape come from these)
STATS = ("retries", "failed", "completed", "submitted", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
         "instance_deaths", "kv_recomputes", "tokens_past_stop")


class RouterTables:
    """Instances, requests and counters of one router, under one lock."""

    def __init__(self, prefill: list[PrefillClient], decode: list[DecodeClient]):
        self.prefill = {c.info.instance_id: c for c in prefill}
        self.decode = {c.info.instance_id: c for c in decode}
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)  # the placement thread: queue or capacity changed
        self.deferred: list[tuple] = []  # (fn, *args) wanted under the lock, run once it is released
        self._tls = threading.local()  # per thread: nesting of locked() (a Condition wait lets others in)
        self.live: dict[str, Tracked] = {}  # request id -> request, until it has finished
        self.by_attempt: dict[str, Tracked] = {}
        self.pending: deque[Tracked] = deque()  # waiting for a decode instance to accept
        self.stopped: dict[str, None] = {}  # attempt ids ended by `stop` (latest 1024): their late tokens count
        self.stats = dict.fromkeys(STATS, 0)
        self.handler_errors = dict.fromkeys(HANDLERS, 0)  # exceptions guards caught (each failed one request)

    @contextmanager
    def locked(self):
        """The lock; calls deferred while it was held run after the outermost release."""
        with self.lock:
            depth = getattr(self._tls, "depth", 0)
            self._tls.depth = depth + 1
            try:
                yield
            finally:
                self._tls.depth = depth
                calls = []
                if depth == 0:
                    calls = list(self.deferred)
                    self.deferred.clear()
        for fn, *args in calls:
            self._safe(fn, *args)

    def _safe(self, fn, *args) -> None:
        """A call deferred until the lock was released (an abort): never raises."""
        try:
            fn(*args)
        except InstanceDeadError:
            pass
        except Exception:  # nothing waits on it: logged and counted, the caller's thread goes on
            logger.exception("deferred call %s%s failed", getattr(fn, "__qualname__", fn), args)
            with self.lock:
                self.handler_errors["deferred"] += 1

    def client(self, instance_id: str) -> PrefillClient | DecodeClient | None:
        return self.prefill.get(instance_id) or self.decode.get(instance_id)

    def abort_attempt(self, tracked: Tracked) -> None:
        """Under the lock: forgets the attempt; its instances are told once the lock is released."""
        self.by_attempt.pop(tracked.attempt_id, None)
        for iid in (tracked.prefill_id, tracked.decode_id):
            client = self.client(iid) if iid is not None else None
            if client is not None:
                self.deferred.append((client.abort, tracked.attempt_id))

    def finish(self, tracked: Tracked, event: StreamEvent) -> None:
        """Under the lock: the request (choice) ends with `event`; a parent with it, when its last
        choice ended."""
        if not tracked.done:
            tracked.done = True
            if self.live.get(tracked.request_id) is tracked:
                del self.live[tracked.request_id]
            tracked.stream.put(event)
            if tracked.parent is not None and all(c.done for c in tracked.parent.choices):
                self.finish(tracked.parent, event)
