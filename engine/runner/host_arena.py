"""The host memory of one rank's KV tier (engine/core/host_tier.py keeps its books on rank 0): a
slot per block, of this rank's heads in every slab, and the copies a step asks for, made before its
forward pass: offloads (pool block -> slot) first, then reloads (slot -> pool block).

On a CPU the arena is memory of its own (sized apart from the pool: --kv-host-tier-gib), so the tier
matters here too; on CUDA it is pinned host memory and the copies are synchronous, before the forward (written, not
run on a GPU yet; overlapping them with compute is a follow-up). Blocks are read and written
through the attention backend's `kv_views`, as forked choices' copies are (a backend may lay a
block's bytes out its own way).

Under it, each rank's files of a disk tier (`files`, engine/runner/disk_files.py DiskFiles): `apply`
makes a step's whole TierCopies (engine/core/tier_copies.py), in its order; the disk reads run on the
files' thread, overlapped with the steps, and `poll_disk` answers which ended.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.core.config import cache_dir
from engine.core.host_tier import HostTier
from engine.core.tier_copies import TierCopies
from engine.core.kv_cache import kv_block_bytes
from engine.runner.disk_files import DiskFiles, identity_of
from engine.runner.disk_tier import DiskTier

if TYPE_CHECKING:
    from engine.core.block_manager import KVCacheManager

logger = logging.getLogger(__name__)


class HostArena:
    def __init__(self, kv_cache: torch.Tensor, kv_views, num_slots: int):
        self.kv_cache, self.kv_views, self.num_slots = kv_cache, kv_views, num_slots
        pin = kv_cache.device.type == "cuda"
        self.slabs = [[torch.empty((num_slots, *view.shape[1:]), dtype=self._plain(view).dtype, pin_memory=pin)
                       for view in kv_views(slab)] for slab in kv_cache]
        self.files: DiskFiles | None = None  # this rank's of a disk tier under the arena
        self.seconds = {"offload": 0.0, "reload": 0.0}  # this rank's copies, since start (the router weighs tiers by them)

    def figures(self) -> dict[str, float]:
        """For the instance's load report: the seconds its copies took (the blocks are the books')."""
        return {f"kv_host_tier_{k}_seconds": v for k, v in self.seconds.items()}

    @staticmethod
    def _plain(view: torch.Tensor) -> torch.Tensor:
        return view.view(torch.uint8) if view.dtype == torch.float8_e4m3fn else view  # no fp8 index_put

    @classmethod
    def for_runner(cls, runner) -> HostArena | None:
        """The arena --kv-host-tier-gib holds under the runner's pool, or None: off (0), or unfit (logged)."""
        gib = runner.config.cache.host_tier_gib
        if gib <= 0:
            return None
        if (why_not := host_tier_unfit(runner)) is not None:
            logger.warning("KV host tier off: %s", why_not)
            return None
        kv_cache = runner.kv_cache
        block_bytes = kv_block_bytes(runner.model_config, runner.num_kv_heads, runner.block_size, runner.kv_dtype)
        num_slots = int(gib * 2**30) // block_bytes
        if num_slots < 1:
            raise ValueError(f"--kv-host-tier-gib {gib:g} holds no KV block of {block_bytes} bytes")
        logger.info("KV host tier: %d blocks (%.2f GiB) under the pool's %d", num_slots, num_slots * block_bytes / 2**30,
                    kv_cache.shape[2] - 1)
        arena = cls(kv_cache, runner.backend.kv_views, num_slots)
        arena.files = disk_files_for(runner, arena)
        return arena

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """One slot's block, a tensor per KV view (the disk tier reads and writes these)."""
        return [host[slot] for hosts in self.slabs for host in hosts]

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One pool block, as `slot_views` lays a slot out (on the host)."""
        return [self._plain(view)[block_id].to("cpu") for slab in self.kv_cache for view in self.kv_views(slab)]

    def apply(self, c: TierCopies) -> None:
        """A step's tier work on this rank, in TierCopies' order, before its forward."""
        if c.disk:
            self.files.apply(c.disk)
        if c.offloads or c.reloads:
            self.copy(c.offloads, c.reloads)
        for key, block_id in c.loads:
            self.write_block(block_id, self.files.take_staged(key))
        if c.drops:
            self.files.drop(c.drops)
        if c.reads:
            self.files.start_reads(c.reads)

    def poll_disk(self, wait_s: float = 0.0) -> list[tuple[int, str]]:
        """This rank's disk reads ended since the last poll (rank 0's books take every rank's)."""
        return [] if self.files is None else self.files.poll(wait_s)

    def write_block(self, block_id: int, tensors: list[torch.Tensor]) -> None:
        """Writes one pool block from tensors laid out as `slot_views` (a disk tier's read)."""
        views = [self._plain(view) for slab in self.kv_cache for view in self.kv_views(slab)]
        assert len(views) == len(tensors)
        for view, t in zip(views, tensors):
            view[block_id] = t.to(view.device)

    def copy(self, offloads: list[tuple[int, int]], reloads: list[tuple[int, int]]) -> None:
        for pairs, out in ((offloads, True), (reloads, False)):
            if not pairs:
                continue
            start = time.perf_counter()  # (synchronous both ways: see the loop)
            a, b = (torch.tensor(ids) for ids in zip(*pairs))
            blocks = (a if out else b).to(self.kv_cache.device)
            slots = b if out else a
            for slab, hosts in zip(self.kv_cache, self.slabs):
                for view, host in zip(self.kv_views(slab), hosts):
                    view = self._plain(view)
                    if out:  # blocking: the slots must hold the KV before anything overwrites the blocks
                        host[slots] = view[blocks].to("cpu")
                    else:
                        view[blocks] = host[slots].to(view.device)
            self.seconds["offload" if out else "reload"] += time.perf_counter() - start


def host_tier_unfit(runner) -> str | None:
    """Why the runner's pool cannot have a host tier, or None."""
    if not runner.config.cache.enable_prefix_caching:
        return "prefix caching is off (the tier holds what the prefix cache evicts)"
    if runner.draft is not None or runner.config.speculative is not None:
        return "speculative decoding (a proposer's KV shares the pool's blocks and would not follow them)"
    return None


def disk_files_for(runner, arena: HostArena) -> DiskFiles | None:
    """This rank's files of the disk tier --kv-disk-tier-gib puts under the arena, or None: off (0),
    or unfit (logged). Under TP each rank's identity names its shard: its files hold its heads."""
    cache = runner.config.cache
    if cache.disk_tier_gib <= 0:
        return None
    if runner.model_path is None:
        logger.warning("KV disk tier off: the weights were given in memory, no files to name its blocks by")
        return None
    root = Path(cache.disk_tier_dir).expanduser() if cache.disk_tier_dir else cache_dir() / "kv"
    views = [v.unsqueeze(0) for v in arena.slot_views(0)]
    shard = (runner.tp.rank, runner.tp.size) if runner.tp is not None else (0, 1)
    identity = identity_of(runner.model_path, views, runner.block_size, runner.backend.name, shard)
    return DiskFiles(root, identity, arena.slot_views, arena.block_views)


def attach_tier(kv: KVCacheManager, runner) -> KVCacheManager:
    """Rank 0: the allocator's books of the runner's host arena (and its disk tier), if it has one."""
    arena = getattr(runner, "host_arena", None)
    if arena is not None:
        disk = None
        if arena.files is not None:
            num_ranks = runner.tp.size if runner.tp is not None else 1
            disk = DiskTier(arena.files, int(runner.config.cache.disk_tier_gib * 2**30), num_ranks)
        kv.tier = HostTier(arena.num_slots, kv.block_pool, disk, len(kv.windows))
    return kv
