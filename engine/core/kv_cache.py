"""The paged KV cache pool of one rank."""
from __future__ import annotations

import torch

from engine.core.config import CacheConfig, ModelConfig


def kv_block_bytes(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across its KV group's layers (all of them with one group: ModelConfig.kv_layout),
    keys and values, in the cache's dtype (fp8: 1 byte)."""
    return cfg.kv_layout.num_slabs * 2 * block_size * num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for(cache: CacheConfig, cfg: ModelConfig, num_kv_heads: int, block_size: int,
                   dtype: torch.dtype, extra_block_bytes: int = 0) -> int:
    """Blocks of `block_size` tokens (the backend's, which may differ from `cache.block_size`):
    a fixed count (`blocks_of_size`), else what `cache.memory_gib` holds (each block also costing
    `extra_block_bytes` elsewhere: a draft model's pool)."""
    if cache.num_blocks is not None:
        return blocks_of_size(cache.num_blocks, cache.block_size, block_size)
    block_bytes = kv_block_bytes(cfg, num_kv_heads, block_size, dtype) + extra_block_bytes
    return max(2, int(cache.memory_gib * 2**30) // block_bytes)


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
