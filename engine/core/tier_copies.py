"""One step's work on a KV pool's tiers (engine/core/host_tier.py decides it on rank 0; every rank
makes it on its own heads, engine/runner/host_arena.py), in this order, before the step's forward:

    disk      writes and deletes of the disk tier's files, in the order decided: a slot's block
              leaves for its file before an offload overwrites the slot, a pool block's before
              the step's reloads or forward overwrite the block
    offloads  pool block -> host slot
    reloads   host slot -> pool block
    loads     a disk read staged in memory (every rank's read checked) -> its pool block
    drops     staged reads no request wants any more
    reads     disk reads to start, on each rank's reader thread: they land in memory while steps
              run, and are answered after a later step (`poll`)

`poll`: disk reads are in flight, so after this step every rank says which of its own ended
(DiskFiles.poll), and rank 0's books take the answers (HostTier.arrived).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SLOT, BLOCK, DELETE = "slot", "block", "delete"  # disk ops: (SLOT, hash, slot), (BLOCK, hash, block id), (DELETE, hash, 0)


@dataclass
class TierCopies:
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (block, host slot)
    reloads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, block)
    disk: list[tuple[str, int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (block hash, block)
    drops: list[int] = field(default_factory=list)  # block hashes
    reads: list[int] = field(default_factory=list)  # block hashes
    poll: bool = False

    @property
    def empty(self) -> bool:
        return not (self.offloads or self.reloads or self.disk or self.loads or self.drops or self.reads or self.poll)
