"""CUDA attention through flash-attn 2 (v2.6+ API), reading K/V straight from the paged cache.

Decodes go to `flash_attn_with_kvcache` (one query token per sequence); prefills and prefill
chunks go to `flash_attn_varlen_func` with a `block_table`, so cached prefix context is read
in place, never gathered. Both use causal masks aligned to the bottom right, which is exactly
"query row r sits at position seq_len - query_len + r".

    tokens:          | d0 | d1 | p0 ......... | p1 ..... |
    query_start_loc: 0    1    2              2+q0       2+q0+q1
    cu_seqlens_q:              0              q0         q0+q1      (rebased to the first prefill token)
    cu_seqlens_k:              0              s0         s0+s1      (seq_lens: cached context + new tokens)

NOTE: flash-attn 2's paged KV requires the page (block) size to be a multiple of 256, hence
`block_size_for`.

flash-attn 2 has no attention sinks (gpt-oss's per-head logit in the softmax's denominator): this
backend does not take them (`takes_sinks` False), and `auto` picks another for a model with sinks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, BaseAttentionBackend, write_kv

logger = logging.getLogger(__name__)

FLASH_PAGE_MULTIPLE = 256


@dataclass
class _DecodePlan:
    num_decodes: int
    seq_lens: torch.Tensor  # (num_decodes,) int32, context incl. the new token
    block_table: torch.Tensor  # (num_decodes, max_num_blocks) int32


@dataclass
class _PrefillPlan:
    token_start: int  # flat index of the first prefill token
    cu_seqlens_q: torch.Tensor  # (num_prefills + 1,) int32, starts at 0
    cu_seqlens_k: torch.Tensor  # (num_prefills + 1,) int32, starts at 0
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # (num_prefills, max_num_blocks) int32


class FlashAttentionBackend(BaseAttentionBackend):
    name = "flash_attn"

    def __init__(self, varlen_fn=None, kvcache_fn=None):
        """Args: varlen_fn / kvcache_fn stand in for `flash_attn.flash_attn_varlen_func` /
        `flash_attn.flash_attn_with_kvcache` (tests); None imports them from flash_attn.
        Raises ImportError when one is needed and flash-attn is not installed."""
        if varlen_fn is None or kvcache_fn is None:
            try:
                import flash_attn
            except ImportError as e:
                raise ImportError("the flash_attn attention backend needs the flash-attn package "
                                  "(pip install flash-attn, v2.6+); use the torch backend without it") from e
            varlen_fn = varlen_fn or flash_attn.flash_attn_varlen_func
            kvcache_fn = kvcache_fn or flash_attn.flash_attn_with_kvcache
        self._varlen = varlen_fn
        self._with_kvcache = kvcache_fn
        self._decode: _DecodePlan | None = None
        self._prefill: _PrefillPlan | None = None

    def block_size_for(self, requested: int) -> int:
        if requested <= 0:
            raise ValueError(f"block_size must be positive, got {requested}")
        size = -(-requested // FLASH_PAGE_MULTIPLE) * FLASH_PAGE_MULTIPLE
        if size != requested:
            logger.info("flash_attn: KV block size %s rounded up to %s (paged KV needs a multiple of %s)",
                        requested, size, FLASH_PAGE_MULTIPLE)
        return size

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        self._decode = None
        if nd:
            self._decode = _DecodePlan(nd, meta.seq_lens[:nd], meta.block_tables[:nd])
        self._prefill = None
        if meta.num_seqs > nd:
            self._prefill = self._plan_prefill(meta)

    @staticmethod
    def _plan_prefill(meta: AttentionMetadata) -> _PrefillPlan:
        nd = meta.num_decodes
        token_start = sum(meta.query_lens[:nd])
        cu_q = meta.query_start_loc[nd:] - meta.query_start_loc[nd]  # stays int32
        cu_k = F.pad(torch.cumsum(meta.seq_lens[nd:], 0, dtype=torch.int32), (1, 0))
        return _PrefillPlan(token_start, cu_q, cu_k, max(meta.query_lens[nd:]), max(meta.seq_lens_cpu[nd:]),
                            meta.block_tables[nd:])

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        self.refuse_sinks(sinks)  # takes_sinks is False: create_attention_backend refuses a model with sinks
        # flash-attn's window counts the keys before a query (and after it): ours includes its own
        window_size = (-1, -1) if window is None else (window - 1, 0)
        # fp8 scales unused: an fp8 cache never reaches flash-attn 2 (create_attention_backend refuses it)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, num_kv_heads, head_dim)
        out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
        if self._decode is not None:
            d = self._decode
            o = self._with_kvcache(q[:d.num_decodes].unsqueeze(1), k_cache, v_cache,
                                   cache_seqlens=d.seq_lens, block_table=d.block_table,
                                   softmax_scale=scale, causal=True,
                                   window_size=window_size,
                                   softcap=softcap or 0.0)  # (num_decodes, 1, num_heads, head_dim)
            out[:d.num_decodes] = o.squeeze(1)
        if self._prefill is not None:
            p = self._prefill
            out[p.token_start:] = self._varlen(q[p.token_start:], k_cache, v_cache,
                                               cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                                               max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k,
                                               softmax_scale=scale, causal=True, block_table=p.block_table,
                                               window_size=window_size, softcap=softcap or 0.0)
        return out
