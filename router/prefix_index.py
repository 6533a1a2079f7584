"""A router's prefix index, fed by the engines: per instance (prefill, decode, colocated), the
block hashes its prefix cache holds, kept by following each instance's KV event log
(engine/core/kv_events.py) from the router's load thread (every 0.1 s, beside its load).

Nothing is guessed at routing time (the index before issue 51 noted each prompt's blocks on the
instance it was sent to, and kept them after the instance evicted them): what an instance stored
shows here within a poll, what it evicted leaves. A new router (a restarted gateway) starts from
each instance's snapshot, and one that falls behind an instance's log, or meets another life of it
(`epoch`), takes a snapshot again. Every router keeps its own index: no shared store on this path.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.core.block_manager import block_hashes
from engine.core.kv_events import CLEARED, REMOVED, STORED
from router.client import DecodeClient, InstanceInfo, PrefillClient


class PrefixIndex:
    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, set[int]] = {}  # instance id -> the block hashes its prefix cache holds
        self._cursor: dict[str, tuple[str, int]] = {}  # instance id -> (its log's epoch, the last event read)
        self.num_snapshots = self.num_events = 0

    def follow(self, client: PrefillClient | DecodeClient) -> None:
        """Reads what the instance's prefix cache stored and evicted since the last call (a
        snapshot on the first, or when the events are gone from its log or from another life)."""
        iid = client.info.instance_id
        epoch, cursor = self._cursor.get(iid, ("", -1))
        got = client.kv_events(cursor)
        if got is None:
            return
        if "events" in got and got["epoch"] != epoch:  # another life of the instance: start over
            got = client.kv_events(-1)
        with self._lock:
            if "snapshot" in got:
                self._held[iid] = set(got["snapshot"])
                self.num_snapshots += 1
            else:
                held = self._held.setdefault(iid, set())
                for op, block_hash in got["events"]:
                    if op == STORED:
                        held.add(block_hash)
                    elif op == REMOVED:
                        held.discard(block_hash)
                    elif op == CLEARED:
                        held.clear()
                self.num_events += len(got["events"])
            self._cursor[iid] = (got["epoch"], got["seq"])

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._held.pop(instance_id, None)
            self._cursor.pop(instance_id, None)

    def longest_prefix(self, prompt_token_ids: Sequence[int], candidates: list[InstanceInfo]) -> dict[str, int]:
        """Per candidate, how many leading full blocks of the prompt (in its engine's block size)
        its prefix cache holds; 0 for one of unknown block size or never followed."""
        hashes_by_size: dict[int, list[int]] = {}
        out = {}
        with self._lock:
            for c in candidates:
                held = self._held.get(c.instance_id)
                if not held or not c.block_size:
                    out[c.instance_id] = 0
                    continue
                hashes = hashes_by_size.get(c.block_size)
                if hashes is None:
                    hashes = hashes_by_size[c.block_size] = block_hashes(prompt_token_ids, c.block_size)
                n = 0
                while n < len(hashes) and hashes[n] in held:
                    n += 1
                out[c.instance_id] = n
        return out
