"""The host memory of one rank's KV tier (engine/core/host_tier.py keeps its books on rank 0): a
slot per block, of this rank's heads in every slab, and the copies a step asks for, made before its
forward pass: offloads (pool block -> slot) first, then reloads (slot -> pool block).

On a CPU the arena is memory of its own (sized apart from the pool: --kv-host-tier-gib), so the tier
matters here too; on CUDA it is pinned host memory and the copies are synchronous, before the forward (written, not
run on a GPU yet; overlapping them with compute is a follow-up). Blocks are read and written
through the attention backend's `kv_views`, as forked choices' copies are (a backend may lay a
block's bytes out its own way).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.core.config import cache_dir
from engine.core.host_tier import HostTier
from engine.core.kv_cache import kv_block_bytes
from engine.runner.disk_tier import DiskTier, identity_of

if TYPE_CHECKING:
    from engine.core.block_manager import KVCacheManager

logger = logging.getLogger(__name__)


class HostArena:
    def __init__(self, kv_cache: torch.Tensor, kv_views, num_slots: int):
        self.kv_cache, self.kv_views, self.num_slots = kv_cache, kv_views, num_slots
        pin = kv_cache.device.type == "cuda"
        self.slabs = [[torch.empty((num_slots, *view.shape[1:]), dtype=self._plain(view).dtype, pin_memory=pin)
                       for view in kv_views(slab)] for slab in kv_cache]
        self.disk: DiskTier | None = None
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
        arena.disk = disk_tier_for(runner, arena)
        return arena

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """One slot's block, a tensor per KV view (the disk tier reads and writes these)."""
        return [host[slot] for hosts in self.slabs for host in hosts]

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One pool block, as `slot_views` lays a slot out (on the host)."""
        return [self._plain(view)[block_id].to("cpu") for slab in self.kv_cache for view in self.kv_views(slab)]

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
    if runner.model_config.kv_layout.num_groups > 1:
        return f"{runner.model_config.kv_layout.num_groups} KV groups (sliding windows): one group only, for now"
    if runner.draft is not None or runner.config.speculative is not None:
        return "speculative decoding (a proposer's KV shares the pool's blocks and would not follow them)"
    return None


def disk_tier_for(runner, arena: HostArena) -> DiskTier | None:
    """The disk tier --kv-disk-tier-gib puts under the arena, or None: off (0), or unfit (logged)."""
    cache = runner.config.cache
    if cache.disk_tier_gib <= 0:
        return None
    if runner.tp is not None and runner.tp.size > 1:  # its reads and writes are rank 0's alone (disk_tier.py)
        logger.warning("KV disk tier off: %d TP ranks (one rank only, for now)", runner.tp.size)
        return None
    if runner.model_path is None:
        logger.warning("KV disk tier off: the weights were given in memory, no files to name its blocks by")
        return None
    root = Path(cache.disk_tier_dir).expanduser() if cache.disk_tier_dir else cache_dir() / "kv"
    views = [v.unsqueeze(0) for v in arena.slot_views(0)]
    identity = identity_of(runner.model_path, views, runner.block_size, runner.backend.name)
    return DiskTier(root, identity, int(cache.disk_tier_gib * 2**30), arena.slot_views, arena.block_views,
                    arena.write_block)


def attach_tier(kv: KVCacheManager, runner) -> KVCacheManager:
    """Rank 0: the allocator's books of the runner's host arena (and its disk tier), if it has one."""
    if getattr(runner, "host_arena", None) is not None:
        kv.tier = HostTier(runner.host_arena.num_slots, kv.block_pool, runner.host_arena.disk)
    return kv
