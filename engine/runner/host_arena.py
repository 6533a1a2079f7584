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
from typing import TYPE_CHECKING

import torch

from engine.core.host_tier import HostTier
from engine.core.kv_cache import kv_block_bytes

if TYPE_CHECKING:
    from engine.core.block_manager import KVCacheManager

logger = logging.getLogger(__name__)


class HostArena:
    def __init__(self, kv_cache: torch.Tensor, kv_views, num_slots: int):
        self.kv_cache, self.kv_views, self.num_slots = kv_cache, kv_views, num_slots
        pin = kv_cache.device.type == "cuda"
        self.slabs = [[torch.empty((num_slots, *view.shape[1:]), dtype=self._plain(view).dtype, pin_memory=pin)
                       for view in kv_views(slab)] for slab in kv_cache]

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
        return cls(kv_cache, runner.backend.kv_views, num_slots)

    def copy(self, offloads: list[tuple[int, int]], reloads: list[tuple[int, int]]) -> None:
        for pairs, out in ((offloads, True), (reloads, False)):
            if not pairs:
                continue
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


def host_tier_unfit(runner) -> str | None:
    """Why the runner's pool cannot have a host tier, or None."""
    if not runner.config.cache.enable_prefix_caching:
        return "prefix caching is off (the tier holds what the prefix cache evicts)"
    if runner.model_config.kv_layout.num_groups > 1:
        return f"{runner.model_config.kv_layout.num_groups} KV groups (sliding windows): one group only, for now"
    if runner.draft is not None or runner.config.speculative is not None:
        return "speculative decoding (a proposer's KV shares the pool's blocks and would not follow them)"
    return None


def attach_tier(kv: KVCacheManager, runner) -> KVCacheManager:
    """Rank 0: the allocator's books of the runner's host arena, if it has one."""
    if getattr(runner, "host_arena", None) is not None:
        kv.tier = HostTier(runner.host_arena.num_slots, kv.block_pool)
    return kv
