"""CUDA attention over an fp8 KV cache through FlashAttention-3 (`flash_attn_interface`, Hopper).

flash-attn 2 has no fp8 KV path; FlashAttention-3's `flash_attn_with_kvcache` reads e4m3 K/V
from a paged cache with per-(sequence, KV head) descales. It takes a varlen query batch
(`cu_seqlens_q`) with a page table, so one call covers the whole step, decodes and prefills:

    tokens:          | d0 | d1 | p0 ......... | p1 ..... |
    cu_seqlens_q:    0    1    2              2+q0       2+q0+q1     (meta.query_start_loc)
    cache_seqlens:   s_d0 s_d1 s_p0           s_p1                   (meta.seq_lens: context incl. new)

Its fp8 kernels take q in e4m3 too, so q is quantized with scale 1.0 (as vLLM does with FA3 and
an fp8 cache); the output comes back in bf16 and is cast to the model's dtype. FA3's paged KV
takes any page size, so the block size is kept as configured.

NOTE: not yet run: the GPU machine this project is lent has no flash-attn installed. The CPU
tests check the call against a pure-torch stand-in written from FA3's documented contract.

No attention sinks (gpt-oss's per-head logit in the softmax's denominator) here: `takes_sinks` is
False, so a model with them never runs on this backend.
"""
from __future__ import annotations

import torch

from engine.attention.base import BaseAttentionBackend, quantize_fp8, write_kv

FA3_CAPABILITY = 9  # Hopper (sm90): FlashAttention-3's kernels are built for it alone


def fa3_fp8_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-3's fp8 KV path cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != FA3_CAPABILITY:
        return f"the GPU is sm{major}{minor}, FlashAttention-3 needs Hopper (sm90)"
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        return "FlashAttention-3 (flash_attn_interface) is not installed"
    return None


class Flash3FP8Backend(BaseAttentionBackend):
    name = "flash_attn"

    def __init__(self, kvcache_fn=None):
        """Args: kvcache_fn stands in for `flash_attn_interface.flash_attn_with_kvcache` (tests)."""
        if kvcache_fn is None:
            from flash_attn_interface import flash_attn_with_kvcache as kvcache_fn
        self._with_kvcache = kvcache_fn
        self._descales: dict[tuple, torch.Tensor] = {}

    def _descale(self, value: float, num_seqs: int, num_kv_heads: int, device) -> torch.Tensor:
        """(num_seqs, num_kv_heads) float32, all `value`: FA3's descale layout, made once per shape."""
        key = (value, num_seqs, num_kv_heads, device)
        if key not in self._descales:
            self._descales[key] = torch.full((num_seqs, num_kv_heads), value, dtype=torch.float32, device=device)
        return self._descales[key]

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        self.refuse_sinks(sinks)  # takes_sinks is False: create_attention_backend refuses a model with sinks
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        layout = (meta.num_seqs, kv_cache.shape[-2], q.device)
        out = self._with_kvcache(
            quantize_fp8(q, 1.0), kv_cache[0], kv_cache[1],  # (num_tokens, heads, hd); (blocks, bs, kv_heads, hd)
            cache_seqlens=meta.seq_lens, page_table=meta.block_tables,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
            q_descale=self._descale(1.0, *layout), k_descale=self._descale(k_scale, *layout),
            v_descale=self._descale(v_scale, *layout), softmax_scale=scale, causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0), softcap=softcap or 0.0)
        return out.to(q.dtype)  # (num_tokens, num_heads, head_dim)
