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
(a block in the pool saves its whole prefill, one in a tier saves it less a copy back), the score a
prefix-aware policy ranks instances by: weights measured by the instance where its load report has
them (`tier_weights`), `TIER_WEIGHTS` until then.
"""
from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

from engine.core.block_manager import block_hashes
from engine.core.kv_events import CLEARED, DISK, HOST, LEVELS, REMOVED, STORED
from router.client import DecodeClient, InstanceInfo, PrefillClient

# what a block held at each level is worth to the score, against one in the pool (llm-d's precise
# scorer weighs a CPU-tier hit below a GPU one likewise): a host-tier hit costs a copy back to the
# pool, a disk hit a read and a checksum first (docs/disaggregation.md, "Prefix cache and remote KV")
TIER_WEIGHTS = {STORED: 1.0, HOST: 0.8, DISK: 0.5}
MIN_MEASURED_BLOCKS = 16  # copies (reads) back from a tier before their seconds per block replace its default
MIN_MEASURED_TOKENS = 512  # prompt tokens computed before their seconds per token are the yardstick


def tier_weights(figures: Mapping[str, float], block_size: int,
                 default: Mapping[str, float] = TIER_WEIGHTS) -> dict[str, float]:
    """What a block at each level is worth on an instance whose load report (`figures`) measured
    both sides: 1 - (seconds to bring it back) / (seconds to compute it), in [0, 1]. A host-tier
    block comes back by one copy (its reloads' seconds per block); a disk block by a read and
    check, then that copy. `default`'s weight where either side is not measured yet (a decode or
    colocated instance reports no prefill seconds)."""
    out = dict(default)
    tokens = figures.get("prefill_tokens_computed", 0.0)
    reloaded = figures.get("kv_host_tier_reloaded_blocks", 0.0)
    if tokens < MIN_MEASURED_TOKENS or reloaded < MIN_MEASURED_BLOCKS or not block_size:
        return out
    compute = figures.get("prefill_busy_s", 0.0) / tokens * block_size
    if compute <= 0:
        return out
    host = figures.get("kv_host_tier_reload_seconds", 0.0) / reloaded
    out[HOST] = min(1.0, max(0.0, 1 - host / compute))
    loaded = figures.get("kv_disk_tier_loaded_blocks", 0.0)
    if loaded >= MIN_MEASURED_BLOCKS:
        disk = figures.get("kv_disk_tier_read_seconds", 0.0) / loaded
        out[DISK] = min(1.0, max(0.0, 1 - (disk + host) / compute))
    return out


class PrefixIndex:
    def __init__(self, weights: dict[str, float] | None = None, measured: bool = True):
        """`weights`: each level's until an instance measures its own (`measured`: `tier_weights`)."""
        self.weights, self.measured = dict(TIER_WEIGHTS if weights is None else weights), measured
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

    def longest_prefix(self, prompt_token_ids: Sequence[int], candidates: list[InstanceInfo],
                       levels: Collection[str] = LEVELS, cache_salt: str | None = None) -> dict[str, int]:
        """Per candidate, how many leading full blocks of the prompt (in its engine's block size)
        it holds at one of `levels` (every level by default); 0 for one of unknown block size or
        never followed. A salted prompt's blocks are hashed from its salt, as its engine hashes them."""
        return {iid: n for iid, (n, _) in self.hits(prompt_token_ids, candidates, levels, cache_salt).items()}

    def hits(self, prompt_token_ids: Sequence[int], candidates: list[InstanceInfo],
             levels: Collection[str] = LEVELS, cache_salt: str | None = None) -> dict[str, tuple[int, float]]:
        """Per candidate, (the leading full blocks of the prompt it holds at one of `levels`, their
        sum weighted by each one's level: the candidate's measured weights, else `weights`)."""
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
                    hashes = hashes_by_size[c.block_size] = block_hashes(prompt_token_ids, c.block_size, cache_salt)
                weights = tier_weights(c.load.figures, c.block_size, self.weights) if self.measured else self.weights
                n, score = 0, 0.0
                while n < len(hashes) and (level := held.get(hashes[n])) in levels:
                    n, score = n + 1, score + weights[level]
                out[c.instance_id] = (n, round(score, 6))  # (sums of weights: ties stay ties)
        return out
