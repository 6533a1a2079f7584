"""The attention-backend interface and the per-step metadata every backend reads.

A step's batch is packed flat, no padding: the new tokens of `num_seqs` sequences laid
end to end, decodes (query length 1) first, then prefills and prefill chunks:

    tokens:  | d0 | d1 | d2 |  p0 ......... |  p1 ..... |
    seq:        0    1    2        3              4
             <-- num_decodes --><---- num_prefills ---->

`query_start_loc[i]:query_start_loc[i+1]` are sequence i's new tokens; `seq_lens[i]` is its
context length *including* them, so its first new token sits at position
`seq_lens[i] - query_lens[i]`. `slot_mapping[t] = block_id * block_size + offset` is where
token t's K/V goes. `block_tables[i]` lists sequence i's physical blocks in logical order,
padded with the null block 0.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int  # sequences with query length 1, at the front of the batch
    query_lens: list[int]  # per sequence, host copy
    seq_lens_cpu: list[int]  # per sequence, host copy (context incl. new tokens)
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32, cumulative query lengths
    seq_lens: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks) int32
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)


class BaseAttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context."""

    name: str = "base"

    def block_size_for(self, requested: int) -> int:
        """The KV block size this backend works with, given the configured one."""
        return requested

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before the first layer: precompute what every layer reuses."""

    def prepare_static_decode(self, meta: AttentionMetadata, max_blocks: int) -> None:
        """`prepare` for a decode-only step over exactly `max_blocks` blocks per sequence, from
        device tensors alone (a CUDA graph captures it); backends without it run decode eagerly."""
        raise NotImplementedError(f"the {self.name} backend has no static decode step")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store k/v at `meta.slot_mapping`, then causal attention of q over the cached context.

        Args:
            q: (num_tokens, num_heads, head_dim)
            k, v: (num_tokens, num_kv_heads, head_dim), the new tokens' keys and values
            kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), this layer's slab
            meta: the step's metadata (see module docstring)
            scale: softmax scale, usually head_dim ** -0.5
        Returns:
            (num_tokens, num_heads, head_dim)
        """


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys and values into their slots. kv_cache: (2, num_blocks, block_size, kv_heads, head_dim)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
