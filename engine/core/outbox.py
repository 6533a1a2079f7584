"""Per-client queues of a worker's outputs.

Several routers (one per gateway) share an instance; each long-polls only the outputs of its own
requests, addressed by `RequestMessage.client_id` (vLLM v1 routes EngineCoreOutputs to its API servers
by `client_index` alike). A client that stops polling for `ttl_s` is gone (its gateway died): the
worker aborts its requests (`drop_silent` names them), so their blocks are freed.
"""
from __future__ import annotations

import threading
import time


class Outbox:
    def __init__(self):
        self._cond = threading.Condition()
        self._queues: dict[str, list] = {}  # client id -> outputs not yet taken
        self._last_poll: dict[str, float] = {}  # client id -> monotonic time of its last take (or add)
        self._client_of: dict[str, str] = {}  # request id -> client id, until forgotten

    def add(self, request_id: str, client_id: str) -> None:
        """A client placed `request_id` here: its outputs are kept for that client from now on."""
        with self._cond:
            self._client_of[request_id] = client_id
            self._queues.setdefault(client_id, [])
            self._last_poll.setdefault(client_id, time.monotonic())

    def put(self, request_id: str, item, last: bool = False) -> None:
        """Queues `item` for the request's client (dropped if the client is gone); `last`: the
        request has no more outputs (it is forgotten)."""
        with self._cond:
            client = self._client_of.pop(request_id, "") if last else self._client_of.get(request_id, "")
            if client in self._queues:
                self._queues[client].append(item)
                self._cond.notify_all()

    def client_of(self, request_id: str) -> str:
        with self._cond:
            return self._client_of.get(request_id, "")

    def forget(self, request_id: str) -> None:
        with self._cond:
            self._client_of.pop(request_id, None)

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
        """Forgets the clients that have not polled for `ttl_s`; returns their requests' ids (the
        caller aborts them)."""
        with self._cond:
            now = time.monotonic()
            gone = {c for c, t in self._last_poll.items() if now - t > ttl_s}
            for c in gone:
                del self._last_poll[c], self._queues[c]
            orphans = [rid for rid, c in self._client_of.items() if c in gone]
            for rid in orphans:
                del self._client_of[rid]
            return orphans
