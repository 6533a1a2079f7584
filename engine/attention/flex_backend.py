"""Attention through torch's FlexAttention (`torch.nn.attention.flex_attention`), compiled: triton
kernels on a GPU, inductor's C++ template on a CPU. The GPU path where flash-attn is absent.

One `flex_attention` call per layer covers the whole packed step, decodes and prefills alike.
Each sequence's context is gathered from its blocks (`gather_kv`, so an fp8 cache is dequantized
on read) end to end into one key sequence, padded with zero rows; the queries are the step's
tokens as packed, padded with zero rows:

    queries: | d0 | d1 | p0 ....... | p1 .... | zeros ............ |   T real of Tq (a power of two)
    keys:    | ctx d0 | ctx d1 | ctx p0 ...... | ctx p1 | zeros .. |   K real of Tk (a power of two)
             key_start[s] = sum of the key counts of the sequences before s

Sequence s's keys are its positions first[s] .. seq_len[s] - 1 (first[s] = 0, or with a window W
the first position any of its queries sees: its first new token's position - W + 1), so a query
of s at position p sees exactly one run of keys, [lo, hi] in the packed key sequence:

    hi = key_start[s] + p - first[s]
    lo = key_start[s] + max(p - W + 1, first[s]) - first[s]     (lo = key_start[s] without a window)

The mask (`mask_mod`) reads those two per-token tensors: causality, the window and the sequence
boundaries in one comparison; padding queries see nothing (lo > hi) and padding keys are past
every hi. The BlockMask (which blocks of 16 queries x 128 keys hold any visible pair, which hold
only visible pairs) is built from lo/hi directly, once per step and window (by the step's first
layer with that window; the others reuse it), not by evaluating the mask over every pair.

Every gathered key row is a written K/V of its sequence, and the padding rows are zeros, never
uninitialized memory: a masked score's weight is exactly 0, but 0 * NaN is NaN, so garbage in a
key block the kernel visits would reach the output. Sliding layers' released blocks (the null
block in their table) lie wholly before first[s], so they are never read.

Shapes: `torch.compile(flex_attention, dynamic=True)` hits an inductor bug in torch 2.13's CPU
C++ template, so it compiles statically, and the query and key counts are padded to powers of two
(at least MIN_QUERIES and MIN_KEYS) so that few shapes compile: 5-11 s each on a 2-core CPU, once
per process (inductor's on-disk cache makes a later process's compile of the same shape take
about a second). The scale and a soft cap are constants of the compiled graph (Dynamo guards on
their values: one model, one graph per shape). On a CPU the kernel's thread count is the step
thread's when it compiled (inductor bakes it in). docs/engine.md, "FlexAttention backend".

Attention sinks (gpt-oss: a logit s_h per query head in the softmax's denominator only) enter as
one more key, the sink key, at index K (the first padding row: zero K and V), seen by every real
query besides its run; the score_mod gives it the score s_h (after the soft cap of the others),
so its weight is exp(s_h) / (Z + exp(s_h)) and its zero value adds nothing:

    keys:    | ctx d0 | ctx d1 | ctx p0 ...... | ctx p1 | sink | zeros .. |   K + 1 real of Tk
                                                          K

NOTE: not the kernel's log-sum-exp (out * sigmoid(lse - s)): torch 2.13's CPU flex does not
lower `return_aux=AuxRequest(lse=True)` ("return_lse is not supported yet"), and this one path
runs on both devices. A step with sinks has its own plan (a key more, its tile in every query
tile's list) and its own graphs (another score_mod).
"""
from __future__ import annotations

import functools
import logging
import shutil
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.attention.base import AttentionMetadata, BaseAttentionBackend, gather_kv, write_kv

logger = logging.getLogger(__name__)

MIN_QUERIES = 256  # padded query count: a power of two, at least this
MIN_KEYS = 2048  # padded key count: a power of two, at least this
Q_BLOCK, KV_BLOCK = 16, 128  # the BlockMask's tile: 16 query rows (a decode batch wastes less) x 128 keys
RECOMPILE_LIMIT = 64  # Dynamo's per-function limit (8 by default): one entry per padded shape and dtype
# triton's tiles on a GPU must divide the BlockMask's (vLLM's FlexAttention backend sets them the same way)
CUDA_KERNEL_OPTIONS = {"BLOCK_M": Q_BLOCK, "BLOCK_N": 64}


def flex_unavailable(device: torch.device) -> str | None:
    """Why the compiled FlexAttention cannot run on `device` (None: it can)."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "triton is not installed (torch.compile's GPU kernels)"
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        compiler = get_cpp_compiler()
        return None if shutil.which(compiler) else f"no C++ compiler ({compiler}) for inductor's CPU kernels"
    return f"device {device.type} (FlexAttention here compiles for cuda or cpu)"


@functools.cache
def compiled_flex_attention():
    """`flex_attention` compiled with static shapes, once per process (Dynamo caches a graph per
    padded shape); raises Dynamo's recompile limit so that those shapes do not exhaust it."""
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        logger.info("flex: torch._dynamo.config.recompile_limit %d -> %d (one compiled graph per padded shape)",
                    torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


@functools.cache
def softcap_score_mod(softcap: float):
    """Gemma 2's soft-capped scores, cap * tanh(score / cap); one function per cap, so that each
    step passes the same object (Dynamo would otherwise see a new closure)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return score_mod


def sink_score_mod(sinks: torch.Tensor, sink_key: torch.Tensor, softcap: float | None):
    """Scores with attention sinks: the sink key's score is the query head's sink logit, the
    others' are soft-capped where the model caps. sinks: (heads,) float32; sink_key: (Tq,) int64,
    each query's sink key (module docstring)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        return torch.where(kv_idx == sink_key[q_idx], sinks[h].to(score.dtype), score)
    return score_mod


def padded(n: int, minimum: int) -> int:
    """The least power of two that is >= n and >= minimum."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclass
class _StepPlan:
    """One step's keys and mask for one window (None: full attention), with or without a sink key."""
    key_slots: torch.Tensor  # (num_keys,) int64, the flat cache slot of each real key, packed
    num_padded_keys: int
    num_padded_queries: int
    block_mask: BlockMask
    sink_key: torch.Tensor | None = None  # (Tq,) int64: each query's sink key, num_keys (-1: padding); None: no sinks


def _runs(meta: AttentionMetadata, window: int | None):
    """Per sequence: the first key position read, and where its keys start in the packed key
    sequence; their total. Host lists (the runner's copies), no device reads."""
    firsts, key_starts, total = [], [], 0
    for q_len, seq_len in zip(meta.query_lens, meta.seq_lens_cpu):
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        firsts.append(first)
        key_starts.append(total)
        total += seq_len - first
    return firsts, key_starts, total


def plan_step(meta: AttentionMetadata, window: int | None, sinks: bool = False) -> _StepPlan:
    """The packed keys' slots and the BlockMask of one step (module docstring's diagrams); `sinks`:
    with the sink key at index num_keys."""
    dev = meta.block_tables.device
    firsts, key_starts, num_keys = _runs(meta, window)
    num_tokens = sum(meta.query_lens)
    num_q, num_k = padded(num_tokens, MIN_QUERIES), padded(num_keys + sinks, MIN_KEYS)
    n = meta.num_seqs
    seq_ids = torch.arange(n, device=dev)
    first, key_start = (torch.tensor(x, dtype=torch.int64, device=dev) for x in (firsts, key_starts))
    query_lens = torch.tensor(meta.query_lens, device=dev)
    seq_lens = meta.seq_lens.long()

    seq_of_q = torch.repeat_interleave(seq_ids, query_lens, output_size=num_tokens)  # (num_tokens,)
    qstart = meta.query_start_loc.long()
    pos = torch.arange(num_tokens, device=dev) - qstart[seq_of_q] + (seq_lens - query_lens)[seq_of_q]
    lo = torch.ones(num_q, dtype=torch.int64, device=dev)  # padding rows: lo 1 > hi 0, nothing seen
    hi = torch.zeros(num_q, dtype=torch.int64, device=dev)
    rel = pos - first[seq_of_q]  # each query's position counted from its sequence's first key
    hi[:num_tokens] = key_start[seq_of_q] + rel
    lo[:num_tokens] = key_start[seq_of_q] + (0 if window is None else (rel - window + 1).clamp_(min=0))

    seq_of_k = torch.repeat_interleave(seq_ids, seq_lens - first, output_size=num_keys)  # (num_keys,)
    key_pos = torch.arange(num_keys, device=dev) - key_start[seq_of_k] + first[seq_of_k]
    blocks = meta.block_tables.long()[seq_of_k, key_pos // meta.block_size]
    slots = blocks * meta.block_size + key_pos % meta.block_size
    sink_key = None
    if sinks:
        sink_key = torch.full((num_q,), -1, dtype=torch.int64, device=dev)
        sink_key[:num_tokens] = num_keys
    return _StepPlan(slots, num_k, num_q, block_mask(lo, hi, num_q, num_k, sink_key), sink_key)


def block_mask(lo: torch.Tensor, hi: torch.Tensor, num_q: int, num_k: int,
               sink_key: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask of "query t sees keys lo[t]..hi[t]" (and its sink key, `sink_key[t]` >= 0): a
    (Q_BLOCK x KV_BLOCK) tile is visited when any row sees any of its keys, and skips the mask
    when every row sees all of them (never the sink key's tile: it lies past every hi)."""
    tile_lo = torch.arange(0, num_k, KV_BLOCK, device=lo.device)  # (num_k / KV_BLOCK,)
    tile_hi = tile_lo + KV_BLOCK - 1
    row_lo, row_hi = lo.view(-1, Q_BLOCK, 1), hi.view(-1, Q_BLOCK, 1)  # (num_q / Q_BLOCK, Q_BLOCK, 1)
    any_seen = ((row_lo <= tile_hi) & (row_hi >= tile_lo)).any(1)  # (num_q / Q_BLOCK, num_k / KV_BLOCK)
    full = ((row_lo <= tile_lo) & (row_hi >= tile_hi)).all(1)
    if sink_key is not None:
        row_sink = sink_key.view(-1, Q_BLOCK, 1)
        any_seen |= ((row_sink >= tile_lo) & (row_sink <= tile_hi)).any(1)
    partial = any_seen & ~full

    def listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query tile, how many key tiles and which (those first, in order)."""
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return tiles.sum(-1, dtype=torch.int32)[None, None], order[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])
        return seen if sink_key is None else seen | (kv_idx == sink_key[q_idx])

    num_partial, partial_ids = listed(partial)
    num_full, full_ids = listed(full)
    return BlockMask.from_kv_blocks(num_partial, partial_ids, num_full, full_ids, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
                                    mask_mod=mask_mod, seq_lengths=(num_q, num_k),
                                    compute_q_blocks=False)  # the transposed lists serve only a backward


def padded_rows(cache: torch.Tensor, slots: torch.Tensor, num_rows: int, dtype: torch.dtype,
                scale: float) -> torch.Tensor:
    """cache (slots, kv_heads, head_dim) rows `slots` as `dtype`, then zero rows up to `num_rows`."""
    out = torch.empty(num_rows, *cache.shape[1:], dtype=dtype, device=cache.device)
    n = slots.shape[0]
    out[n:].zero_()
    if cache.dtype == dtype:
        torch.index_select(cache, 0, slots, out=out[:n])
    else:
        out[:n] = gather_kv(cache, slots, dtype, scale)
    return out


class FlexAttentionBackend(BaseAttentionBackend):
    name = "flex"
    takes_sinks = True

    def __init__(self, device: torch.device):
        """Raises ValueError where the compiled kernels cannot be built (no silent eager path: torch's
        uncompiled flex_attention materializes every score)."""
        if (why := flex_unavailable(device)) is not None:
            raise ValueError(f"attention backend flex cannot run: {why}; use --attention-backend torch")
        self._flex = compiled_flex_attention()
        self._kernel_options = CUDA_KERNEL_OPTIONS if device.type == "cuda" else None
        self._meta: AttentionMetadata | None = None
        self._plans: dict[tuple, _StepPlan] = {}  # per window and sinks or not, this step's
        self._shapes: set[tuple] = set()  # padded shapes this backend has run (the first one compiles)

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._plans = {}

    def _plan(self, window: int | None, sinks: bool) -> _StepPlan:
        if (window, sinks) not in self._plans:
            self._plans[window, sinks] = plan_step(self._meta, window, sinks)
        return self._plans[window, sinks]

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        plan = self._plan(window, sinks is not None)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        keys = padded_rows(flat[0], plan.key_slots, plan.num_padded_keys, q.dtype, k_scale)  # (Tk, kv_heads, hd)
        values = padded_rows(flat[1], plan.key_slots, plan.num_padded_keys, q.dtype, v_scale)
        query = q.new_zeros(plan.num_padded_queries, num_heads, head_dim)  # (Tq, heads, hd)
        query[:num_tokens] = q
        self._note_shape(query, keys, softcap, sinks is not None)
        cap = None if softcap is None else float(softcap)
        if sinks is not None:
            score_mod = sink_score_mod(sinks.float(), plan.sink_key, cap)
        else:
            score_mod = None if cap is None else softcap_score_mod(cap)
        out = self._flex(query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                         score_mod=score_mod, block_mask=plan.block_mask, scale=scale,
                         enable_gqa=num_heads != num_kv_heads,
                         kernel_options=self._kernel_options)  # (1, heads, Tq, hd)
        return out[0, :, :num_tokens].transpose(0, 1).contiguous()  # (num_tokens, heads, hd)

    def _note_shape(self, query: torch.Tensor, keys: torch.Tensor, softcap: float | None, sinks: bool) -> None:
        """Logs each padded shape the first time this backend runs it: the process's first call of a
        shape compiles it (or loads inductor's on-disk kernels), which takes seconds; with sinks, the
        sink score_mod's graph is another."""
        shape = (tuple(query.shape), tuple(keys.shape), query.dtype, softcap, sinks)
        if shape not in self._shapes:
            self._shapes.add(shape)
            logger.info("flex: %d queries x %d keys (padded), %s heads on %s KV heads, %s%s%s: a new shape "
                        "(compiled on its first call in this process)", query.shape[0], keys.shape[0],
                        query.shape[1], keys.shape[1], str(query.dtype).removeprefix("torch."),
                        "" if softcap is None else f", softcap {softcap}", ", sinks" if sinks else "")
