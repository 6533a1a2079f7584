"""The paged KV cache pool of one rank."""
from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelConfig


def kv_block_bytes(cfg: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return cfg.num_layers * 2 * block_size * num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_blocks_for(cache: CacheConfig, cfg: ModelConfig, num_kv_heads: int, block_size: int,
                   dtype: torch.dtype) -> int:
    """Blocks of `block_size` tokens (the backend's, which may differ from `cache.block_size`)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    return max(2, int(cache.memory_gib * 2**30) // kv_block_bytes(cfg, num_kv_heads, block_size, dtype))


def allocate_kv_cache(cfg: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor for the whole pool.

    Shape: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim). Each layer is one
    contiguous slab `kv[layer]`, so a layer can be shipped as soon as it is computed; index 0
    of the second axis holds keys, 1 values. `num_kv_heads` is this rank's share. Block 0 is
    the null block: padding in block tables points at it, and nothing is ever stored there.
    """
    shape = (cfg.num_layers, 2, num_blocks, block_size, num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
