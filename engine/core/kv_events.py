"""What an instance's prefix cache holds, as a log its readers follow: every block it stored under
its hash, every one it evicted, and every reset, each with a sequence number (vLLM's and Dynamo's
KV events; llm-d's precise prefix index is fed by them).

A reader (a router's prefix-aware policy, router/policy.py) keeps a cursor: `since(cursor)` gives
the events after it, or, where the log no longer holds them all (it keeps the last `capacity`), or
the cursor is from another life of the instance (ahead of the log), a snapshot of the hashes held
now. So any number of readers follow one instance, and a new reader (a restarted gateway) starts
from a snapshot: nothing is lost by being away.

Each held block has a level, the fastest the instance can reuse it from (issue 51: the router's
score weighs them): its pool (`stored`), its host-memory tier or its disk tier (`moved`, as the
tiers under the pool take it: engine/core/host_tier.py). A reader of an older version ignores the
`moved` events and reads the snapshot's hashes alone: a block in a tier is held to it, as before.

Only group 0's keys are logged (engine/core/block_manager.py: a block's key is its chained hash in
the first KV group, (group, hash) in the others): they are what a router hashes a prompt into.
Thread-safe: the step thread appends, readers' RPC threads read.
"""
from __future__ import annotations

import secrets
import threading
from collections import deque

STORED, REMOVED, CLEARED = "+", "-", "0"
HOST, DISK = "h", "d"  # `moved` events: the block's fastest level is now the host tier, the disk tier
LEVELS = (STORED, HOST, DISK)  # a held block's level, fastest first (STORED: the instance's KV pool)


class KVEventLog:
    def __init__(self, capacity: int):
        self._lock = threading.Lock()
        self._log: deque[tuple[str, int]] = deque(maxlen=capacity)
        self._held: dict[int, str] = {}  # what the events so far leave held, at which level: the snapshot
        self.seq = 0  # events appended so far
        self.epoch = secrets.token_hex(4)  # this log's life: a reader's cursor from another is void

    def _append(self, op: str, block_hash: int) -> None:
        self._log.append((op, block_hash))
        self.seq += 1

    def stored(self, key) -> None:
        self._set(key, STORED)

    def moved(self, key, level: str) -> None:
        """The block's fastest level is now `level` (HOST or DISK): it left the pool, or a tier."""
        assert level in (HOST, DISK), level
        self._set(key, level)

    def _set(self, key, level: str) -> None:
        if type(key) is int:
            with self._lock:
                if self._held.get(key) != level:  # a level said again is no news
                    self._held[key] = level
                    self._append(level, key)

    def removed(self, key) -> None:
        if type(key) is int:
            with self._lock:
                if self._held.pop(key, None) is not None:  # one not held is no news
                    self._append(REMOVED, key)

    def cleared(self) -> None:
        with self._lock:
            self._held.clear()
            self._append(CLEARED, 0)

    def since(self, cursor: int) -> dict:
        """{"epoch", "seq": the log's sequence number now, and "events": [(op, hash), ...] after
        `cursor`, or, where those events are not all in the log (a cursor of -1 always), "snapshot":
        [hash, ...] held now at any level and "tiers": {HOST: [hash, ...], DISK: [...]}, those of
        them held in a tier alone}."""
        with self._lock:
            missing = self.seq - cursor
            if 0 <= missing <= len(self._log):
                return {"epoch": self.epoch, "seq": self.seq, "events": list(self._log)[len(self._log) - missing:]}
            tiers: dict[str, list[int]] = {HOST: [], DISK: []}
            for key, level in self._held.items():
                if level != STORED:
                    tiers[level].append(key)
            return {"epoch": self.epoch, "seq": self.seq, "snapshot": list(self._held), "tiers": tiers}

    def level(self, key: int) -> str | None:
        """The level the events so far leave `key` at; None: not held."""
        with self._lock:
            return self._held.get(key)
