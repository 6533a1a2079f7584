"""Reference and CPU attention over K/V gathered from blocks.

Decodes (query length 1) run batched: their context blocks are gathered whole (one
`index_select` of block rows, far cheaper than gathering slot by slot) into a padded
`(num_decodes, max_ctx, num_kv_heads * head_dim)` tensor, used as it lies: each query head is
spread over all KV heads' columns, with zeros outside its own KV head's (`_head_mask`), so
one `bmm` scores every head against its own keys without the permute copy that a
`(num_kv_heads, max_ctx, head_dim)` layout would cost (measured 8x faster for SmolLM2 at batch
32). A float32 softmax over a -inf padding bias, a second `bmm`, and the same mask, summed over
the KV-head axis, give each head's output. Each prefill (or prefill chunk) runs as
its own scaled_dot_product_attention call, with a causal mask shifted by its cached context.

Small decode batches (at most SMALL_DECODE_KV gathered positions in all, e.g. batch 1 at a few
hundred tokens) take another path: one scaled_dot_product_attention over the gathered K/V in
float32. There the masked bmm's cost is per call, not per FLOP, and bf16 bmm on a CPU is slow
at these sizes (measured, SmolLM2 batch 1 at 176 positions: 108 us in bf16 against 55 us for
SDPA in fp32; at 8 x 256 they tie, at 32 x 256 the masked bmm is 1.6x faster).

An fp8 cache (`--kv-cache-dtype fp8_e4m3`) is dequantized to the compute dtype as it is read:
only the gathered rows, never the whole pool (`gather_kv`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import FP8, AttentionMetadata, BaseAttentionBackend, gather_kv, write_kv

SMALL_DECODE_KV = 512  # decode batches with at most this many gathered K/V positions run SDPA in fp32


@dataclass
class _DecodePlan:
    block_ids: torch.Tensor  # (num_decodes * max_blocks,) int64, each sequence's table, padded
    bias: torch.Tensor  # (num_decodes, 1, max_ctx) float32: 0 inside the context, -inf past it


@dataclass
class _PrefillPlan:
    token_start: int
    query_len: int
    slots: torch.Tensor  # (seq_len,) int64
    mask: torch.Tensor | None  # (query_len, seq_len) bool; None when there is no cached context


def context_slots(block_table: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions 0..num_positions-1 of each row. block_table: (num_seqs, max_blocks)."""
    pos = torch.arange(num_positions, device=block_table.device)
    blocks = block_table[:, pos // block_size].long()  # (num_seqs, num_positions)
    return blocks * block_size + pos % block_size


class TorchAttentionBackend(BaseAttentionBackend):
    name = "torch"

    def __init__(self):
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillPlan] = []
        self._head_masks: dict[tuple, torch.Tensor] = {}

    def _head_mask(self, num_heads: int, num_kv_heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
        """(num_heads, num_kv_heads * head_dim): 1 on the columns of each head's own KV head."""
        key = (num_heads, num_kv_heads, head_dim, like.dtype, like.device)
        if key not in self._head_masks:
            group = num_heads // num_kv_heads
            kv_of_head = torch.arange(num_heads, device=like.device) // group
            kv_of_col = torch.arange(num_kv_heads * head_dim, device=like.device) // head_dim
            self._head_masks[key] = (kv_of_head[:, None] == kv_of_col[None, :]).to(like.dtype)
        return self._head_masks[key]

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        self._decode = None
        if nd:
            self._plan_decodes(meta, nd, -(-max(meta.seq_lens_cpu[:nd]) // meta.block_size))
        self._prefills = []
        starts = meta.query_start_loc.tolist()
        for i in range(nd, meta.num_seqs):
            q_len, seq_len = meta.query_lens[i], meta.seq_lens_cpu[i]
            slots = context_slots(meta.block_tables[i:i + 1], seq_len, meta.block_size)[0]
            mask = None
            if seq_len > q_len:
                # query row r sits at position seq_len - q_len + r and sees keys up to it
                q_pos = torch.arange(seq_len - q_len, seq_len, device=slots.device)
                mask = torch.arange(seq_len, device=slots.device)[None, :] <= q_pos[:, None]
            self._prefills.append(_PrefillPlan(starts[i], q_len, slots, mask))

    def prepare_static_decode(self, meta: AttentionMetadata, max_blocks: int) -> None:
        """A decode-only step over exactly `max_blocks` blocks per sequence, with no host reads:
        what a CUDA graph captures (engine/cuda_graphs.py)."""
        self._plan_decodes(meta, meta.num_decodes, max_blocks)
        self._prefills = []

    def _plan_decodes(self, meta: AttentionMetadata, nd: int, max_blocks: int) -> None:
        block_ids = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
        pos = torch.arange(max_blocks * meta.block_size, device=block_ids.device)
        bias = torch.zeros(nd, 1, pos.numel(), device=block_ids.device)
        bias.masked_fill_((pos[None, :] >= meta.seq_lens[:nd, None]).view(nd, 1, -1), float("-inf"))
        self._decode = _DecodePlan(block_ids, bias)

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[:meta.num_decodes] = self._decode_attention(q[:meta.num_decodes], kv_cache, scale, k_scale, v_scale)
        for plan in self._prefills:
            s, e = plan.token_start, plan.token_start + plan.query_len
            # no cached context: the new K/V are the whole context; but an fp8 cache is read back
            # even then, so that every query sees K/V as the cache holds them (chunked or not)
            if plan.mask is None and kv_cache.dtype != FP8:
                out[s:e] = self._attend(q[s:e], k[s:e], v[s:e], None, scale)
            else:
                ks = gather_kv(flat[0], plan.slots, q.dtype, k_scale)  # (seq_len, kv_heads, head_dim)
                vs = gather_kv(flat[1], plan.slots, q.dtype, v_scale)
                out[s:e] = self._attend(q[s:e], ks, vs, plan.mask, scale)
        return out

    def _decode_attention(self, q, kv_cache, scale, k_scale, v_scale):
        nd, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        width = num_kv_heads * head_dim
        ids = self._decode.block_ids
        k = gather_kv(kv_cache[0], ids, q.dtype, k_scale).view(nd, -1, width)  # (nd, max_ctx, kv_heads * hd)
        v = gather_kv(kv_cache[1], ids, q.dtype, v_scale).view(nd, -1, width)
        if nd * k.shape[1] <= SMALL_DECODE_KV:
            return self._small_decode(q, k, v, num_kv_heads, scale)
        mask = self._head_mask(num_heads, num_kv_heads, head_dim, q)  # (heads, kv_heads * hd)
        q_spread = q.repeat(1, 1, num_kv_heads) * mask  # (nd, heads, kv_heads * hd)
        scores = torch.bmm(q_spread, k.transpose(1, 2)).float() * scale + self._decode.bias  # (nd, heads, max_ctx)
        out = torch.bmm(scores.softmax(-1).to(q.dtype), v) * mask  # (nd, heads, kv_heads * hd)
        return out.view(nd, num_heads, num_kv_heads, head_dim).sum(2)

    def _small_decode(self, q, k, v, num_kv_heads, scale):
        """q: (nd, heads, head_dim); k, v: (nd, max_ctx, kv_heads * head_dim) -> (nd, heads, head_dim)."""
        nd, num_heads, head_dim = q.shape
        kh = k.float().view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)  # (nd, kv_heads, max_ctx, hd)
        vh = v.float().view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.float().unsqueeze(2), kh, vh, attn_mask=self._decode.bias.unsqueeze(1),
                                           scale=scale, enable_gqa=True)  # (nd, heads, 1, hd)
        return o.squeeze(2).to(q.dtype)

    @staticmethod
    def _attend(q, k, v, mask, scale):
        """One sequence. q: (q_len, num_heads, head_dim); k, v: (seq_len, kv_heads, head_dim)."""
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        kh = k.transpose(0, 1).unsqueeze(0)  # (1, kv_heads, seq_len, head_dim)
        vh = v.transpose(0, 1).unsqueeze(0)
        if mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # (q_len, num_heads, head_dim)
