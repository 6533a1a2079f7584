"""The paged KV cache pool of one rank."""
from __future__ import annotations

import logging

import torch

from engine.config import CacheConfig, ModelConfig

logger = logging.getLogger(__name__)


def kv_block_bytes(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across its KV group's layers (all of them with one group: ModelConfig.kv_layout),
    keys and values, in the cache's dtype (fp8: 1 byte)."""
    return cfg.kv_layout.num_slabs * 2 * block_size * num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for(cache: CacheConfig, cfg: ModelConfig, num_kv_heads: int, block_size: int,
                   dtype: torch.dtype) -> int:
    """Blocks of `block_size` tokens (the backend's, which may differ from `cache.block_size`):
    a fixed count (`blocks_of_size`), else what `cache.memory_gib` holds."""
    if cache.num_blocks is not None:
        return blocks_of_size(cache.num_blocks, cache.block_size, block_size)
    return max(2, int(cache.memory_gib * 2**30) // kv_block_bytes(cfg, num_kv_heads, block_size, dtype))


def blocks_of_size(num_blocks: int, requested: int, block_size: int) -> int:
    """A fixed `num_kv_blocks`, given in blocks of the configured `requested` tokens, as blocks of
    the backend's `block_size`: at least the same usable tokens (block 0 is the null block), and
    about the same bytes, where a backend rounds the block size up (vllm_cpu: 16 -> 32)."""
    if block_size == requested:
        return num_blocks
    return max(2, -(-(num_blocks - 1) * requested // block_size) + 1)


def allocate_kv_cache(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor for the whole pool.

    Shape: (num_slabs, 2, num_blocks, block_size, num_kv_heads, head_dim). Each slab is one layer
    of each KV group (`cfg.kv_layout`; one group: slab i is layer i), contiguous, so a layer can
    be shipped as soon as it is computed; a block holds the layers of the group it went to; index 0
    of the second axis holds keys, 1 values. `num_kv_heads` is this rank's share. Block 0 is
    the null block: padding in block tables points at it, and nothing is ever stored there.
    `dtype` is the cache's (`resolve_kv_cache_dtype`): the model's, or float8_e4m3fn, whose
    per-layer scales the attention layers hold (engine/attention/base.py, write_kv).
    """
    shape = (cfg.kv_layout.num_slabs, 2, num_blocks, block_size, num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def blocks_from_device(runner, block_bytes: int) -> int:
    """KV blocks one CUDA rank can hold: `gpu_memory_utilization` of its device, less this
    process's peak (weights, plus a profiling forward at `max_num_batched_tokens`: the largest
    step the scheduler makes), in blocks of `block_bytes`. Process-local (torch's allocator, not
    the device's free memory), so instances sharing a GPU each take their own fraction; the CUDA
    context itself (a few hundred MiB) is outside the count."""
    device, cache = runner.device, runner.config.cache
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.profile_forward(runner.config.scheduler.max_num_batched_tokens)
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * cache.gpu_memory_utilization) - peak
    logger.info("KV from the device: %.2f of %.1f GiB for this rank, %.2f GiB of it weights and the activation "
                "peak of a %d-token step, %.2f GiB left for KV", cache.gpu_memory_utilization, total / 2**30,
                peak / 2**30, runner.config.scheduler.max_num_batched_tokens, max(budget, 0) / 2**30)
    if budget // block_bytes < 2:
        raise ValueError(f"gpu_memory_utilization {cache.gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB "
                         f"for KV after {peak / 2**30:.2f} GiB of weights and activations: raise it, or lower "
                         "max_num_batched_tokens")
    return budget // block_bytes
