"""Per-client queues of a worker's outputs.

Several routers (one per gateway) share an instance; each long-polls only the outputs of its own
requests, addressed by `Request.client_id` (vLLM v1 routes EngineCoreOutputs to its API servers
by `client_index` alike). A client that stops polling for `ttl_s` is gone (its gateway died): the
worker aborts its requests, so their blocks are freed.
"""
from __future__ import annotations

import threading
import time


class Outbox:
    def __init__(self):
        self._cond = threading.Condition()
        self._queues: dict[str, list] = {}  # client id -> outputs not yet taken
        self._last_poll: dict[str, float] = {}  # client id -> monotonic time of its last take (or register)

    def register(self, client_id: str) -> None:
        """A client placed a request here: its outputs are kept for it from now on."""
        with self._cond:
            self._queues.setdefault(client_id, [])
            self._last_poll.setdefault(client_id, time.monotonic())

    def put(self, client_id: str, items: list) -> None:
        """Queues outputs for `client_id`; dropped if the client is gone."""
        with self._cond:
            if client_id in self._queues and items:
                self._queues[client_id].extend(items)
                self._cond.notify_all()

    def take(self, client_id: str, timeout: float) -> list:
        """Everything queued for `client_id`, waiting up to `timeout` for the first (long poll)."""
        with self._cond:
            self._queues.setdefault(client_id, [])
            self._last_poll[client_id] = time.monotonic()
            if not self._queues[client_id] and timeout > 0:
                self._cond.wait_for(lambda: bool(self._queues.get(client_id)), timeout)
            out, self._queues[client_id] = self._queues.get(client_id, []), []
            self._last_poll[client_id] = time.monotonic()
            return out

    def drop_silent(self, ttl_s: float) -> list[str]:
        """Forgets the clients that have not polled for `ttl_s`; returns their ids."""
        with self._cond:
            now = time.monotonic()
            gone = [c for c, t in self._last_poll.items() if now - t > ttl_s]
            for c in gone:
                del self._last_poll[c], self._queues[c]
            return gone
