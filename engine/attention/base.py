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

Attention sinks (gpt-oss): a learned logit `s_h` per query head that joins each softmax's
denominator and nothing else (it has no value): weights exp(score_j) / (sum_j exp(score_j) +
exp(s_h)). A backend that applies them says so in `takes_sinks`; `create_attention_backend`
refuses a model with sinks on one that does not.
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
    own_kv_layout = False  # True: the blocks are laid out for this backend's kernels (kv_views reads them)
    has_static_decode = False  # True: `prepare_static_decode` plans a decode step from device tensors alone
    takes_sinks: bool = False  # True: forward applies `sinks` (attention sinks, module docstring)

    def block_size_for(self, requested: int) -> int:
        """The KV block size this backend works with, given the configured one."""
        return requested

    def fused_ops(self, dtype: torch.dtype) -> frozenset[str]:
        """Which of the model's "rms_norm" and "rotary" run in this backend's library's kernels."""
        return frozenset()

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer's slab (2, num_blocks, block_size, kv_heads, head_dim), each
        a (num_blocks, block_size, kv_heads, head_dim) view indexed by token, however this backend
        lays the bytes out: what the KV transfer reads and writes through."""
        return layer[0], layer[1]

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError, at load, if this backend cannot attend heads of `head_dim`."""

    def refuse_sinks(self, sinks: torch.Tensor | None) -> None:
        """Raises ValueError when `sinks` reach a backend that cannot apply them (no `takes_sinks`)."""
        if sinks is not None and not self.takes_sinks:
            raise ValueError(f"attention backend {self.name} cannot take attention sinks")

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before the first layer: precompute what every layer reuses."""

    def prepare_static_decode(self, meta: AttentionMetadata, max_blocks: int) -> None:
        """`prepare` for a decode-only step over exactly `max_blocks` blocks per sequence, from
        device tensors alone (a CUDA graph captures it); backends without it run decode eagerly."""
        raise NotImplementedError(f"the {self.name} backend has no static decode step")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store k/v at `meta.slot_mapping`, then causal attention of q over the cached context.

        Args:
            q: (num_tokens, num_heads, head_dim)
            k, v: (num_tokens, num_kv_heads, head_dim), the new tokens' keys and values
            kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), this layer's slab
            meta: the step's metadata (see module docstring)
            scale: softmax scale, usually head_dim ** -0.5
            k_scale, v_scale: this layer's fp8 KV scales (write_kv); unused by a full-precision cache
            window: a sliding layer's window, the keys a query sees with its own (positions
                p - window + 1 .. p); None: every key up to its own
            softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2)
            sinks: (num_heads,) float32, this rank's query heads' sink logits (gpt-oss): each joins
                its head's softmax denominator after the cap and the mask; None: no sinks. Only a
                backend with `takes_sinks` accepts them
        Returns:
            (num_tokens, num_heads, head_dim)
        """


# The fp8 KV cache (--kv-cache-dtype fp8_e4m3): per layer, K and V each have a scale (vLLM's
# k_scale / v_scale); the cache holds x / scale in e4m3 and attention reads fp8 * scale.
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, so larger values saturate here


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest even), clamped to +-448 (a cast alone may give NaN past it)."""
    if scale != 1.0:  # in fp32, so that bf16 input is rounded once, not twice
        x = x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp8 K or V as `dtype`, times its scale."""
    if x.device.type != "cpu":
        out = x.to(dtype)
        return out if scale == 1.0 else out * scale
    # NOTE: the CPU's fp8 casts are scalar code, most of an fp8 decode step. The same bits moved into
    # an fp16's fields are the value / 256 exactly (bias 15 against 7; subnormals too), and the fp16
    # -> fp32 -> dtype casts are vectorized (3-4x faster in all). int8 sign-extends: << 7 puts the
    # sign at bit 15 and a stray one at bit 14, which & 0xBFFF clears. 0x7f (NaN) is never stored:
    # quantize_fp8 saturates.
    bits = x.view(torch.int8).to(torch.int16)
    bits <<= 7
    bits &= 0xBFFF
    out = bits.view(torch.float16).float().mul_(256.0 * scale)  # fp32: no rounding before `dtype`'s
    return out if dtype == torch.float32 else out.to(dtype)


def gather_kv(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`cache.index_select(0, index)` (rows of K or V) as the compute dtype: an fp8 cache's rows
    are gathered as bytes (index_select need not have fp8 kernels), then dequantized."""
    if cache.dtype != FP8:
        return cache.index_select(0, index)
    return dequantize_fp8(cache.view(torch.uint8).index_select(0, index).view(FP8), dtype, scale)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new keys and values into their slots. kv_cache: (2, num_blocks, block_size, kv_heads, head_dim).
    An fp8 cache stores `quantize_fp8(k, k_scale)` and `quantize_fp8(v, v_scale)`."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if flat.dtype == FP8:  # NOTE: index_copy_ has no fp8 kernel (CPU): the fp8 bytes move as uint8
        flat = flat.view(torch.uint8)
        k, v = quantize_fp8(k, k_scale).view(torch.uint8), quantize_fp8(v, v_scale).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
