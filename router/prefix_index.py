"""A router's prefix index, fed by the engines: per instance (prefill, decode, colocated), the
block hashes its prefix cache holds, kept by following each instance's KV event log
(engine/core/kv_events.py) from the router's load thread (every 0.1 s, beside its load).

Nothing is guessed at routing time (the index before issue 51 noted each prompt's blocks on the
instance it was sent to, and kept them after the instance evicted them): what an instance stored
shows here within a poll, what it evicted leaves. A new router (a restarted gateway) starts from
each instance's snapshot, and one that falls behind an instance's log, or meets another life of it
(`epoch`), takes a snapshot again. Every router keeps its own index: no shared store on this path.

Each block is held at a level: the instance's KV pool, or its host or disk tier under the pool
(engine/core/kv_events.py). `longest_prefix` counts the leading blocks held at any level (what the
engine can reuse: the router's available and routed counters); `hits` also weighs each by its level
(`TIER_WEIGHTS`: a block in the pool saves its whole prefill, one in a tier saves it less a copy
back), the score a prefix-aware policy ranks instances by.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.core.block_manager import block_hashes
from engine.core.kv_events import CLEARED, DISK, HOST, LEVELS, REMOVED, STORED
from router.client import DecodeClient, InstanceInfo, PrefillClient

# what a block held at each level is worth to the score, against one in the pool (llm-d's precise
# scorer weighs a CPU-tier hit below a GPU one likewise): a host-tier hit costs a copy back to the
# pool, a disk hit a read and a checksum first (docs/disaggregation.md, "Prefix cache and remote KV")
TIER_WEIGHTS = {STORED: 1.0, HOST: 0.8, DISK: 0.5}


class PrefixIndex:
    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(TIER_WEIGHTS if weights is None else weights)
        assert set(self.weights) == set(LEVELS), self.weights
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, str]] = {}  # instance id -> block hash -> the level it is held at
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
            if "snapshot" in got:  # (an instance of a version before tiers sends no "tiers": all in its pool)
                held = self._held[iid] = dict.fromkeys(got["snapshot"], STORED)
                for level, hashes in got.get("tiers", {}).items():
                    held.update(dict.fromkeys(hashes, level))
                self.num_snapshots += 1
            else:
                held = self._held.setdefault(iid, {})
                for op, block_hash in got["events"]:
                    if op in self.weights:
                        held[block_hash] = op
                    elif op == REMOVED:
                        held.pop(block_hash, None)
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
        it holds at any level; 0 for one of unknown block size or never followed."""
        return {iid: n for iid, (n, _) in self.hits(prompt_token_ids, candidates).items()}

    def hits(self, prompt_token_ids: Sequence[int], candidates: list[InstanceInfo]) -> dict[str, tuple[int, float]]:
        """Per candidate, (the leading full blocks of the prompt it holds at any level, their sum
        weighted by each one's level: `weights`)."""
        hashes_by_size: dict[int, list[int]] = {}
        out = {}
        with self._lock:
            for c in candidates:
                held = self._held.get(c.instance_id)
                if not held or not c.block_size:
                    out[c.instance_id] = (0, 0.0)
                    continue
                hashes = hashes_by_size.get(c.block_size)
                if hashes is None:
                    hashes = hashes_by_size[c.block_size] = block_hashes(prompt_token_ids, c.block_size)
                n, score = 0, 0.0
                while n < len(hashes) and (level := held.get(hashes[n])) is not None:
                    n, score = n + 1, score + self.weights[level]
                out[c.instance_id] = (n, round(score, 6))  # (sums of weights: ties stay ties)
        return out
