"""Reference and CPU attention over K/V gathered from blocks.

Decodes (query length 1) run batched: their context blocks are gathered whole (one
`index_select` of block rows, far cheaper than gathering slot by slot) into a padded
`(num_decodes, max_ctx, num_kv_heads * head_dim)` tensor, viewed per KV head, and attended by one
scaled_dot_product_attention in float32 over a -inf padding bias (GQA by `enable_gqa`; on a GPU
in the model dtype with each KV head's query heads as one query's rows: `decode_sdpa`). Each
prefill (or prefill chunk) runs as its own scaled_dot_product_attention call in the model dtype,
with a causal mask shifted by its cached context.

Larger bf16 decode batches on a CPU (8 sequences or more, over BMM_MIN_KV gathered positions) use a masked `bmm`
instead, in the model dtype: each query head is spread over all KV heads' columns, with zeros
outside its own KV head's (`_head_mask`), so one `bmm` scores every head against its own keys
with no permute copy; a float32 softmax over the bias, a second `bmm` and the same mask, summed
over the KV-head axis, give each head's output. bf16 `bmm` runs through oneDNN, which JIT-builds
and keeps a kernel for every shape it meets: fed each step's exact (batch, context), a server's
memory grew without bound (a bf16 soak: +360 MB over 600 requests). So the batch is padded to a
multiple of 8 and the context to a multiple of 64 positions up to 512, a power of two beyond: a
few hundred shapes at most (the soak: +15 MB, flat).

Measured per layer, SmolLM2's 9 query / 3 KV heads, 2 threads: batch 1 at 176 positions, fp32
SDPA 55 us, bf16 masked bmm 108; batch 8 x 256: 207 and 225; batch 32 x 256: 796 and 486 (W1,
batch 32 to 256 positions, ran 28% slower with fp32 SDPA for every decode). In fp32 SDPA is the
faster at every size.

A sliding layer (`window` W: each query sees its own key and the W - 1 before it) takes the same
gathers under a bias or mask that also hides keys W or more positions back, built once per step
for each window the model has.

An fp8 cache (`--kv-cache-dtype fp8_e4m3`) is dequantized to the compute dtype as it is read:
only the gathered rows, never the whole pool (`gather_kv`).

Attention sinks (gpt-oss: a logit per head in the softmax's denominator only, engine/attention/base.py)
take the written-out path that soft-capping takes (`_attention`), prefill and decode alike (decode in
its grouped view), never SDPA or the masked bmm: the masked scores get the head's sink logit as one
more column, a float32 softmax runs over them, and the column is dropped, as transformers' eager gpt-oss.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import FP8, AttentionMetadata, BaseAttentionBackend, gather_kv, write_kv

# bf16 CPU decode batches of at least BMM_MIN_BATCH sequences and over BMM_MIN_KV gathered positions
# in all use the masked bmm; a smaller batch would pay for the padding to 8 rows (batch 1 at 1024
# positions: SDPA 1.3 ms a layer, the padded bmm 5.4)
BMM_MIN_KV = 512
BMM_MIN_BATCH = 8


def _hide_outside(bias: torch.Tensor, seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """bias: (rows, 1, ctx) zeros -> -inf at positions past each row's context, and with a window
    at those `window` or more before its last position (rows past seq_lens' are left alone)."""
    n = seq_lens.shape[0]
    pos = torch.arange(bias.shape[-1], device=bias.device)[None, :]
    hide = pos >= seq_lens[:, None]
    if window is not None:
        hide |= pos < seq_lens[:, None] - window
    bias[:n].masked_fill_(hide.view(n, 1, -1), float("-inf"))
    return bias


@dataclass
class _DecodePlan:
    block_ids: torch.Tensor  # (num_decodes * max_blocks,) int64, each sequence's table, padded
    tables: torch.Tensor  # (num_decodes, max_blocks) the tables, for the masked bmm's padded plan
    seq_lens: torch.Tensor  # (num_decodes,)
    block_size: int
    # per window (None: full attention), the (num_decodes, 1, max_ctx) float32 bias: 0 where a key
    # is seen, -inf past the context (and outside the window)
    biases: dict = field(default_factory=dict)
    padded: dict = field(default_factory=dict)  # per window, block ids and bias for the masked bmm

    def bias(self, window: int | None) -> torch.Tensor:
        if window not in self.biases:
            nd, max_blocks = self.tables.shape
            zeros = torch.zeros(nd, 1, max_blocks * self.block_size, device=self.tables.device)
            self.biases[window] = _hide_outside(zeros, self.seq_lens, window)
        return self.biases[window]


@dataclass
class _PrefillPlan:
    token_start: int
    query_len: int
    slots: torch.Tensor  # (seq_len,) int64
    masks: dict = field(default_factory=dict)  # per window, (query_len, seq_len) bool, None: causal

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Which keys each query row sees; None when plain causal attention over the new tokens is it
        (no cached context, no window that cuts the chunk)."""
        if window not in self.masks:
            seq_len, q_len = self.slots.shape[0], self.query_len
            mask = None
            if seq_len > q_len or (window is not None and q_len > window):
                # query row r sits at position seq_len - q_len + r and sees keys up to it
                q_pos = torch.arange(seq_len - q_len, seq_len, device=self.slots.device)[:, None]
                k_pos = torch.arange(seq_len, device=self.slots.device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            self.masks[window] = mask
        return self.masks[window]


def context_slots(block_table: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions 0..num_positions-1 of each row. block_table: (num_seqs, max_blocks)."""
    pos = torch.arange(num_positions, device=block_table.device)
    blocks = block_table[:, pos // block_size].long()  # (num_seqs, num_positions)
    return blocks * block_size + pos % block_size


class TorchAttentionBackend(BaseAttentionBackend):
    name = "torch"
    takes_sinks = True
    has_static_decode = True
    GROUPED_DECODE_DEVICES = ("cuda",)  # device types whose decode SDPA views query heads per KV head (decode_sdpa)

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
            self._prefills.append(_PrefillPlan(starts[i], q_len, slots))

    def prepare_static_decode(self, meta: AttentionMetadata, max_blocks: int) -> None:
        """A decode-only step over exactly `max_blocks` blocks per sequence, with no host reads:
        what a CUDA graph captures (engine/runner/cuda_graphs.py)."""
        self._plan_decodes(meta, meta.num_decodes, max_blocks)
        self._prefills = []

    def _plan_decodes(self, meta: AttentionMetadata, nd: int, max_blocks: int) -> None:
        block_ids = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
        self._decode = _DecodePlan(block_ids, meta.block_tables[:nd, :max_blocks], meta.seq_lens[:nd],
                                   meta.block_size)

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[:meta.num_decodes] = self._decode_attention(q[:meta.num_decodes], kv_cache, scale, k_scale, v_scale,
                                                            window, softcap, sinks)
        for plan in self._prefills:
            s, e = plan.token_start, plan.token_start + plan.query_len
            mask = plan.mask(window)
            # the new K/V are the whole context; but an fp8 cache is read back even then, so that
            # every query sees K/V as the cache holds them (chunked or not)
            if plan.slots.shape[0] == plan.query_len and kv_cache.dtype != FP8:
                out[s:e] = self._attend(q[s:e], k[s:e], v[s:e], mask, scale, softcap, sinks)
            else:
                ks = gather_kv(flat[0], plan.slots, q.dtype, k_scale)  # (seq_len, kv_heads, head_dim)
                vs = gather_kv(flat[1], plan.slots, q.dtype, v_scale)
                out[s:e] = self._attend(q[s:e], ks, vs, mask, scale, softcap, sinks)
        return out

    def _decode_attention(self, q, kv_cache, scale, k_scale, v_scale, window, softcap, sinks):
        ids = self._decode.block_ids
        written_out = softcap is not None or sinks is not None  # the masked bmm has neither
        if (not written_out and q.device.type == "cpu" and q.dtype != torch.float32 and q.shape[0] >= BMM_MIN_BATCH
                and ids.numel() * kv_cache.shape[2] > BMM_MIN_KV):
            return self._masked_bmm(q, kv_cache, scale, k_scale, v_scale, window)
        k, v = _gather_rows(kv_cache, ids, q.shape[0], q.dtype, k_scale, v_scale)
        return self.decode_sdpa(q, k, v, kv_cache.shape[-2], scale, self._decode.bias(window), softcap, sinks)

    def _padded_plan(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and bias for the masked bmm, the batch padded to a multiple of 8 (rows of the
        null block, bias 0: finite, dropped) and the context to a multiple of 64 positions up to
        512, a power of two beyond (null blocks under a -inf bias); built once per step."""
        plan = self._decode
        if window not in plan.padded:
            nd, max_blocks = plan.tables.shape
            rows = -(-nd // 8) * 8
            tokens = max_blocks * plan.block_size
            tokens = -(-tokens // 64) * 64 if tokens <= 512 else 1 << (tokens - 1).bit_length()
            blocks = -(-tokens // plan.block_size)
            ids = torch.zeros(rows, blocks, dtype=torch.long, device=plan.tables.device)
            ids[:nd, :max_blocks] = plan.tables
            bias = torch.zeros(rows, 1, blocks * plan.block_size, device=ids.device)
            plan.padded[window] = ids.view(-1), _hide_outside(bias, plan.seq_lens, window)
        return plan.padded[window]

    def _masked_bmm(self, q, kv_cache, scale, k_scale, v_scale, window):
        nd, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        ids, bias = self._padded_plan(window)
        rows = bias.shape[0]
        k, v = _gather_rows(kv_cache, ids, rows, q.dtype, k_scale, v_scale)
        if rows > nd:
            q = torch.cat([q, q.new_zeros(rows - nd, num_heads, head_dim)])
        mask = self._head_mask(num_heads, num_kv_heads, head_dim, q)  # (heads, kv_heads * hd)
        q_spread = q.repeat(1, 1, num_kv_heads) * mask  # (rows, heads, kv_heads * hd)
        scores = torch.bmm(q_spread, k.transpose(1, 2)).float() * scale + bias  # (rows, heads, ctx)
        out = torch.bmm(scores.softmax(-1).to(q.dtype), v) * mask  # (rows, heads, kv_heads * hd)
        return out[:nd].view(nd, num_heads, num_kv_heads, head_dim).sum(2)

    @classmethod
    def decode_sdpa(cls, q, k, v, num_kv_heads, scale, bias, softcap=None, sinks=None):
        """q: (nd, heads, head_dim); k, v: (nd, max_ctx, kv_heads * head_dim) -> (nd, heads, head_dim);
        sinks: (heads,) float32 or None.

        On a GPU, and with soft-capping or sinks anywhere, each KV head's group of query heads
        attends as the rows of one query, (nd, kv_heads, group, head_dim) against (nd, kv_heads,
        max_ctx, head_dim), so that no kernel repeats K/V per query head (SDPA's GQA under a mask takes the
        math kernel, which does: GiBs a layer at an 8B shape's decode batch), and on a GPU in the
        model's dtype, so that SDPA's memory-efficient kernel runs. On a CPU, SDPA's own GQA in
        float32: there the grouped view measured up to 1.2x slower at batch 1 and about level at
        batches 8 to 32 (SmolLM2's 9 on 3 heads; BENCHMARKS.md, "The torch backend's decode layouts")."""
        nd, num_heads, head_dim = q.shape
        if softcap is None and sinks is None and q.device.type not in cls.GROUPED_DECODE_DEVICES:
            kh = k.float().view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)  # (nd, kv_heads, max_ctx, hd)
            vh = v.float().view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
            o = _attention(q.float().unsqueeze(2), kh, vh, bias.unsqueeze(1), scale, None)  # (nd, heads, 1, hd)
            return o.squeeze(2).to(q.dtype)
        dtype = q.dtype if q.device.type == "cuda" else torch.float32
        qg = q.to(dtype).view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kh = k.to(dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        vh = v.to(dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        sinks = None if sinks is None else sinks.view(num_kv_heads, -1, 1)  # (kv_heads, group, 1), as qg's heads
        o = _attention(qg, kh, vh, bias.to(dtype).unsqueeze(1), scale, softcap, sinks)  # (nd, kv_heads, group, hd)
        return o.reshape(nd, num_heads, head_dim).to(q.dtype)

    @staticmethod
    def _attend(q, k, v, mask, scale, softcap=None, sinks=None):
        """One sequence. q: (q_len, num_heads, head_dim); k, v: (seq_len, kv_heads, head_dim); sinks: (num_heads,)."""
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        kh = k.transpose(0, 1).unsqueeze(0)  # (1, kv_heads, seq_len, head_dim)
        vh = v.transpose(0, 1).unsqueeze(0)
        if mask is None and softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if mask is None:
                mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
            o = _attention(qh, kh, vh, mask, scale, softcap, None if sinks is None else sinks.view(-1, 1, 1))
        return o[0].transpose(0, 1)  # (q_len, num_heads, head_dim)


def _attention(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with GQA, or with the scores written out (SDPA has neither soft-capping nor sinks):
    scores q k * scale, capped to cap * tanh(score / cap), masked, the sink logits appended as one
    more column, a float32 softmax, the column dropped; as transformers' eager Gemma 2 and gpt-oss.
    q: (B, heads, Lq, hd); k, v: (B, kv_heads, Lk, hd); mask: bool (True = seen) or an additive bias;
    sinks: float32 that expands to (B, heads, Lq, 1), one logit per query head: (heads, 1, 1) per query row."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if (group := q.shape[1] // k.shape[1]) > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, heads, Lq, Lk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    scores = scores.float()
    with_sink = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)  # (B, heads, Lq, Lk + 1)
    return with_sink.softmax(-1)[..., :-1].to(q.dtype) @ v


def _gather_rows(kv_cache, ids, rows: int, dtype, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks `ids` (rows x blocks each), as (rows, ctx, kv_heads * head_dim) in `dtype`."""
    width = kv_cache.shape[-2] * kv_cache.shape[-1]
    return (gather_kv(kv_cache[0], ids, dtype, k_scale).view(rows, -1, width),
            gather_kv(kv_cache[1], ids, dtype, v_scale).view(rows, -1, width))
