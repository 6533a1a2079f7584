"""A disk tier under the host tier (issue 51): a block the host tier drops (its least recently used)
is written to a file of its own, and a prompt whose next blocks are there has them read back, on a
thread of their own while steps run, then copied into its new pool blocks instead of computed.

Two parts. Every rank's files (engine/runner/disk_files.py DiskFiles: the step's writes and deletes,
reads on a reader thread into memory, each rank its own heads' files). Rank 0's books here
(`DiskTier`, what engine/core/host_tier.py asks of a disk tier) over all ranks' files: which blocks
the disk holds (rank 0's files; those another instance wrote to a shared directory found as they
are asked for), least recently used first, bounded by --kv-disk-tier-gib; the ops each step
carries; the reads in flight and the ranks' answers: a block is staged once every rank read and
checked its shard, refused (counted, forgotten, computed again) when any rank refused its file.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from engine.core.tier_copies import BLOCK, DELETE, SLOT
from engine.runner.disk_files import GONE, HEADER_BYTES, OK, DiskFiles

logger = logging.getLogger(__name__)


class DiskTier:
    """Rank 0's books of the disk tier (what engine/core/host_tier.py asks of one: DiskBooks), over
    every rank's files; `files`: rank 0's, whose directory says what the disk holds."""

    def __init__(self, files: DiskFiles, capacity_bytes: int, num_ranks: int = 1):
        self.files, self.capacity, self.num_ranks = files, capacity_bytes, num_ranks
        self.block_bytes = sum(t.numel() * t.element_size() for t in files.slot_views(0)) + HEADER_BYTES
        self._files: OrderedDict[int, int] = OrderedDict()  # block hash -> bytes, least recently used first
        self._bytes = 0
        for key, size in files.found():
            self._files[key] = size
            self._bytes += size
        self._refused: set[int] = set()
        self._ops: list[tuple[str, int, int]] = []  # this step's writes and deletes, in order
        self._reads: list[int] = []  # to start with this step
        self._answers: dict[int, list[str]] = {}  # reads in flight: the ranks' answers so far
        self._staged: set[int] = set()  # read and checked on every rank, held in memory there
        self._claimed: set[int] = set()  # staged blocks an admission claimed (loaded or released next)
        self._loads: list[tuple[int, int]] = []
        self._drops: list[int] = []
        self.on_forget: Callable[[int], None] | None = None  # the host tier's: a block it no longer holds
        self.stats = {"spilled_blocks": 0, "loaded_blocks": 0, "refused_blocks": 0, "deleted_blocks": 0}
        logger.info("KV disk tier: %s, %d blocks there (%.2f of %.2f GiB)%s%s", files.dir, len(self._files),
                    self._bytes / 2**30, self.capacity / 2**30, "" if files.writable else ", read-only",
                    f", {num_ranks} ranks' shards" if num_ranks > 1 else "")

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def figures(self) -> dict[str, float]:
        return {"kv_disk_tier_blocks": float(len(self._files)), "kv_disk_tier_bytes": float(self._bytes),
                "kv_disk_tier_read_seconds": self.files.read_s,
                "kv_disk_tier_write_failures": float(self.files.stats["write_failures"]),
                **{f"kv_disk_tier_{k}": float(v) for k, v in self.stats.items()}}

    def has(self, key: int) -> bool:
        """Whether a file of the block is there (one another instance wrote to a shared directory too)."""
        if key in self._files:
            return True
        if key in self._refused:
            return False
        try:
            size = self.files.path(key).stat().st_size
        except OSError:
            return False
        self._files[key] = size
        self._bytes += size
        return True

    # -- writes ------------------------------------------------------------------------------------
    def spill(self, key: int, slot: int) -> bool:
        """The host slot's block is written under `key` by this step; whether the tier holds it then."""
        return self._write(key, (SLOT, key, slot))

    def spill_block(self, key: int, block_id: int) -> bool:
        """The pool block `block_id` (its KV still there until this step runs) is written under `key`."""
        return self._write(key, (BLOCK, key, block_id))

    def _write(self, key: int, op: tuple[str, int, int]) -> bool:
        if key in self._files:
            self._files.move_to_end(key)
            return True
        if not self.files.writable:
            return False
        self._ops.append(op)
        self._files[key] = self.block_bytes
        self._bytes += self.block_bytes
        self._refused.discard(key)
        self.stats["spilled_blocks"] += 1
        while self._bytes > self.capacity and len(self._files) > 1:
            old = next(iter(self._files))
            self._ops.append((DELETE, old, 0))
            self.stats["deleted_blocks"] += 1
            self._forget(old)
        return True

    # -- reads -------------------------------------------------------------------------------------
    def reading(self, key: int) -> bool:
        return key in self._answers

    def staged(self, key: int) -> bool:
        return key in self._staged and key not in self._claimed

    def fetch(self, keys: list[int]) -> None:
        """Every rank starts reading these blocks with the next step (those not read or staged yet)."""
        for key in keys:
            if key not in self._answers and key not in self._staged and self.has(key):
                self._answers[key] = []
                self._reads.append(key)
                self._files.move_to_end(key)

    def arrived(self, answers: list[list[tuple[int, str]]]) -> list[int]:
        """Every rank's answers since the last poll; returns the blocks staged now (read on all ranks).
        A block any rank refused is forgotten (counted; each rank logged why), one a rank found
        gone forgotten too; its copies on the ranks that read it are dropped."""
        for rank_answers in answers:
            for key, answer in rank_answers:
                got = self._answers.get(key)
                if got is None:  # a read the books gave up on (cleared): let its copy go
                    if answer == OK:
                        self._drops.append(key)
                    continue
                got.append(answer)
        staged = []
        for key, got in list(self._answers.items()):
            if len(got) < self.num_ranks:
                continue
            del self._answers[key]
            if all(a == OK for a in got):
                self._staged.add(key)
                self.stats["loaded_blocks"] += 1
                staged.append(key)
                continue
            if OK in got:
                self._drops.append(key)
            if any(a not in (OK, GONE) for a in got):
                self.stats["refused_blocks"] += 1
                self._refused.add(key)
            self._forget(key)
        return staged

    def claim(self, key: int) -> None:
        assert self.staged(key)
        self._claimed.add(key)

    def unclaim(self, key: int) -> None:
        self._claimed.discard(key)

    def load(self, key: int, block_id: int) -> None:
        """The claimed staged block is copied into the pool block `block_id` at the next step's start."""
        self._claimed.remove(key)
        self._staged.remove(key)
        self._loads.append((key, block_id))

    def drop(self, keys) -> None:
        """Staged blocks no request wants (claimed ones stay)."""
        for key in keys:
            if key in self._staged and key not in self._claimed:
                self._staged.remove(key)
                self._drops.append(key)

    @property
    def busy(self) -> bool:
        """Ops to carry, or reads to poll for: a step should run, with nothing to compute if need be."""
        return bool(self._ops or self._reads or self._answers or self._loads or self._drops)

    def take(self) -> tuple[list[tuple[str, int, int]], list[tuple[int, int]], list[int], list[int], bool]:
        """This step's (disk ops, loads, drops, reads, poll)."""
        out = (self._ops, self._loads, self._drops, self._reads, bool(self._answers))
        self._ops, self._loads, self._drops, self._reads = [], [], [], []
        return out

    def _forget(self, key: int) -> None:
        self._bytes -= self._files.pop(key, 0)
        if self.on_forget is not None:
            self.on_forget(key)

    def clear(self) -> None:
        """Deletes this instance's known files (the prefix cache was reset: the KV may be stale): rank
        0's at once (what the books read by), every rank's with the next step."""
        for key in list(self._files):
            self.files.delete(key)
            self._ops.append((DELETE, key, 0))
            self.stats["deleted_blocks"] += 1
            self._forget(key)
        self.drop(list(self._staged))
        self._answers.clear()  # their answers are dropped as they come
