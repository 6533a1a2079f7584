"""Reference and CPU attention: scaled_dot_product_attention over K/V gathered from blocks.

Decodes (query length 1) run as one batched call: their contexts are gathered into a padded
`(num_decodes, num_kv_heads, max_ctx, head_dim)` tensor, and the query heads that share a KV
head ride along as the "query length" axis, so GQA needs no K/V expansion. Each prefill (or
prefill chunk) runs as its own call with a causal mask shifted by its cached context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, BaseAttentionBackend, write_kv


@dataclass
class _DecodePlan:
    slots: torch.Tensor  # (num_decodes, max_ctx) int64, flat slot of each context position
    mask: torch.Tensor  # (num_decodes, 1, 1, max_ctx) bool, True where attention is allowed


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

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        self._decode = None
        if nd:
            max_ctx = max(meta.seq_lens_cpu[:nd])
            slots = context_slots(meta.block_tables[:nd], max_ctx, meta.block_size)
            pos = torch.arange(max_ctx, device=slots.device)
            mask = (pos[None, :] < meta.seq_lens[:nd, None]).view(nd, 1, 1, max_ctx)
            self._decode = _DecodePlan(slots, mask)
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

    def forward(self, q, k, v, kv_cache, meta, scale):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[:meta.num_decodes] = self._decode_attention(q[:meta.num_decodes], flat, scale)
        for plan in self._prefills:
            s, e = plan.token_start, plan.token_start + plan.query_len
            if plan.mask is None:  # no cached context: the new K/V are the whole context
                out[s:e] = self._attend(q[s:e], k[s:e], v[s:e], None, scale)
            else:
                out[s:e] = self._attend(q[s:e], flat[0][plan.slots], flat[1][plan.slots], plan.mask, scale)
        return out

    def _decode_attention(self, q, flat, scale):
        nd, num_heads, head_dim = q.shape
        num_kv_heads = flat.shape[2]
        group = num_heads // num_kv_heads
        k = flat[0][self._decode.slots].transpose(1, 2)  # (nd, kv_heads, max_ctx, head_dim)
        v = flat[1][self._decode.slots].transpose(1, 2)
        qg = q.view(nd, num_kv_heads, group, head_dim)  # the group axis plays "query length"
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=self._decode.mask, scale=scale)
        return o.reshape(nd, num_heads, head_dim)

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
