"""DeepSeek's multi-head latent attention (MLA) over the paged KV cache.

A token's keys and values for every head come from one latent: `c_kv = norm(x W_DKV)`
(`kv_lora_rank` wide) and a rotary key `k_pe` (`qk_rope_head_dim` wide) shared by all heads. Head
h's key is `[c_kv W_UK[h] | k_pe]` and its value `c_kv W_UV[h]`, where kv_b_proj = [W_UK; W_UV]
per head. So the cache holds one entry per token and layer, `[c_kv | k_pe]`: 576 numbers for
DeepSeek-V3 against 128 heads x (192 + 128) of expanded keys and values.

The entry lives in the KV pool as it is laid out for every model (engine/core/kv_cache.py): one KV head
whose two planes, "keys" and "values", hold the entry's first and second halves (head_dim =
entry / 2). Block manager, prefix cache, fp8 option and KV transfer carry it unchanged; every TP
rank holds the whole entry (it is not split by heads), as GQA replicates a KV head over ranks.

Attention, in two forms with the same numbers up to rounding (tests/engine/layers/test_mla.py):
- expanded: kv_b_proj turns each context token's latent into per-head keys and values, then
  plain attention (keys qk_head_dim wide, values v_head_dim);
- absorbed: W_UK folded into the query (`q_nope W_UK[h]`, kv_lora_rank wide), scores against the
  latent itself plus `q_pe . k_pe`, the latent mixed by the softmax, then W_UV applied: reads the
  entries alone, no per-head expansion of the context.
Decodes run absorbed. A prefill of q new tokens runs the form timed faster at load for its range
of q on the model's own weights (`select_prefill_forms`; the model runner logs the times).

The checkpoint's rotary dims are interleaved pairs (x0, x1), (x2, x3) (V2's complex rotation, V3's
`rope_interleave`); their rows of q and of kv_a_proj_with_mqa are reordered at load to the
half-split layout the shared rotary embedding applies (`deinterleave_rows`): the products q . k
are the same sums, in the order transformers' V3 computes them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, BaseAttentionBackend
from engine.attention.base import gather_kv, write_kv
from engine.core.choices import PrefillForms
from engine.core.config import ModelConfig
from engine.layers.common import RMSNorm, RotaryEmbedding
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup
from engine.quant.base import BaseLinearMethod

# (largest query count of the range, the count timed; None: any larger); each over a context of twice
# the count (a chunk after as many cached tokens)
PREFILL_BUCKETS = ((16, 16), (128, 128), (None, 512))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope scaling
    sets it (DeepSeek's reference; transformers' `yarn_apply_mscale`)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def deinterleave_rows(w: torch.Tensor, rope: int, every: int) -> torch.Tensor:
    """w's rows in groups of `every` (a head's, or one), the last `rope` of each group reordered from
    interleaved pairs (0, 1), (2, 3), ... to halves (0, 2, 4, ... | 1, 3, 5, ...)."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + (every - rope)
    rows = torch.arange(w.shape[0]).view(-1, every).clone()
    rows[:, every - rope:] = rows[:, order]
    return w[rows.flatten()]


class MLAAttention(nn.Module):
    """One layer's latent attention; the cache slab is (2, num_blocks, block_size, 1, entry / 2)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused_rotary: bool = False, window: int | None = None):
        super().__init__()
        assert not fused_rotary and window is None, "MLA runs its own rotary and no window"
        mla, one = cfg.mla, TPGroup()  # `one`: replicated layers, every rank the whole weight
        self.mla, self.num_heads = mla, cfg.num_heads // tp.size
        self.num_kv_heads, self.head_dim = 1, cfg.head_dim  # the cache's view of an entry
        self.scale, self.prefill_forms = softmax_scale(cfg), PrefillForms.fixed("expanded")
        self.decode_form = "absorbed"  # "expanded": one sequence at a time (tests and bench/mla_steps.py)
        heads = cfg.num_heads
        self.q_a_proj = self.q_a_layernorm = self.q_b_proj = self.q_proj = None
        if mla.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, mla.q_lora_rank, tp=one, linear_method=linear_method)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, tp=tp,
                                                 linear_method=linear_method)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * mla.qk_head_dim, tp=tp,
                                               linear_method=linear_method)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, mla.entry_size, tp=one,
                                                       linear_method=linear_method)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        # unquantized whatever the method: the absorbed form reads its weight as W_UK and W_UV
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                              tp=tp)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, cfg.hidden_size, tp=tp, linear_method=linear_method)
        self.k_scale = self.v_scale = 1.0  # fp8 KV scales of the entry's two halves (as LlamaAttention's)

    def forward(self, rope, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        mla, n = self.mla, hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(n, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_pe = RotaryEmbedding.apply(q_pe, *rope)
        k_pe = RotaryEmbedding.apply(k_pe.unsqueeze(1), *rope)[:, 0]
        entry = torch.cat([self.kv_a_layernorm(c_kv.contiguous()), k_pe], dim=-1)  # (n, entry)
        half = self.head_dim
        write_kv(kv_cache, entry[:, :half].unsqueeze(1), entry[:, half:].unsqueeze(1), meta.slot_mapping,
                 self.k_scale, self.v_scale)
        out = hidden.new_empty(n, self.num_heads, mla.v_head_dim)
        d = meta.num_decodes
        if d and self.decode_form == "absorbed":
            out[:d] = self.attend_absorbed(q_nope[:d], q_pe[:d], kv_cache, meta, range(d))
        starts = meta.query_start_loc.tolist()
        for i in range(d if self.decode_form == "absorbed" else 0, meta.num_seqs):
            rows = slice(starts[i], starts[i + 1])
            form = self.decode_form if i < d else self.prefill_forms.form(starts[i + 1] - starts[i])
            attend = self.attend_absorbed if form == "absorbed" else self.attend_expanded
            out[rows] = attend(q_nope[rows], q_pe[rows], kv_cache, meta, [i])
        return self.o_proj(out.reshape(n, -1))

    def context(self, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of sequences `seqs` (their whole contexts, the new tokens' included), padded
        to the longest: (len(seqs), L, entry) in the compute dtype, and (len(seqs), L) valid."""
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        longest, bs = max(lens), meta.block_size
        pos = torch.arange(longest, device=kv_cache.device)
        tables = meta.block_tables[list(seqs), :(longest + bs - 1) // bs].long()
        slots = (tables[:, pos // bs] * bs + pos % bs).flatten()
        _, num_blocks, block_size, _, half = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, half)
        dtype = self.kv_b_proj.weight.dtype
        entries = torch.cat([gather_kv(flat[0], slots, dtype, self.k_scale),
                             gather_kv(flat[1], slots, dtype, self.v_scale)], dim=-1)
        valid = pos[None, :] < torch.tensor(lens, device=pos.device)[:, None]
        return entries.view(len(lens), longest, -1), valid

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, seqs) -> torch.Tensor:
        """Decodes (one query each, seqs the batch's first len(q)) or one sequence's queries (its last
        len(q) positions), in latent space: (len(q), heads, v_head_dim)."""
        entries, valid = self.context(kv_cache, meta, seqs)
        c_kv, k_pe = entries.split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1)
        if len(seqs) > 1 or q_nope.shape[0] == 1:  # decodes: query b attends sequence b's context
            return self.absorbed(q_nope.unsqueeze(1), q_pe.unsqueeze(1), c_kv, k_pe, valid[:, None, :])[:, 0]
        mask = _causal(q_nope.shape[0], c_kv.shape[1], c_kv.device)
        return self.absorbed(q_nope[None], q_pe[None], c_kv, k_pe, mask[None])[0]

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """The absorbed form over B contexts: q_nope (B, q, heads, nope), q_pe (B, q, heads, rope),
        c_kv (B, L, kv_lora_rank), k_pe (B, L, rope), mask (B, q, L) True where visible ->
        (B, q, heads, v_head_dim)."""
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, self.mla.kv_lora_rank).split(
            [self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=1)
        q_lat = torch.einsum("bqhn,hnr->bqhr", q_nope, w_uk)
        scores = torch.einsum("bqhr,blr->bhql", q_lat, c_kv) + torch.einsum("bqhp,blp->bhql", q_pe, k_pe)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores * self.scale, dim=-1, dtype=torch.float32).to(c_kv.dtype)
        latent = torch.einsum("bhql,blr->bqhr", probs, c_kv)  # mixed in latent space, then W_UV
        return torch.einsum("bqhr,hvr->bqhv", latent, w_uv)

    def attend_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, seqs) -> torch.Tensor:
        """One sequence's queries (its last len(q) positions) against per-head keys and values
        expanded from its context's latents: (len(q), heads, v_head_dim)."""
        entries, _ = self.context(kv_cache, meta, seqs)
        c_kv, k_pe = entries[0].split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1)
        return self.expanded(q_nope, q_pe, c_kv, k_pe)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor) -> torch.Tensor:
        """The expanded form, one sequence: q_nope (q, heads, nope), q_pe (q, heads, rope), its context's
        c_kv (L, kv_lora_rank) and k_pe (L, rope), the queries its last q positions -> (q, heads, v)."""
        mla, length = self.mla, c_kv.shape[0]
        kv = self.kv_b_proj(c_kv).view(length, self.num_heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        mask = _causal(q.shape[0], length, q.device)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)


def _causal(q_len: int, length: int, device: torch.device) -> torch.Tensor:
    """(q_len, length) True where key j is visible to query i, the queries being the last q_len positions."""
    rows = torch.arange(length - q_len, length, device=device)[:, None]
    return torch.arange(length, device=device)[None, :] <= rows


def time_prefill_forms(layer: MLAAttention, rounds: int = 3) -> PrefillForms:
    """Both forms on `layer`'s weights at each PREFILL_BUCKETS count (random queries and latents,
    the model's dtype), best of `rounds`; each range runs the faster."""
    from engine.layers.expert_compute import best_ms
    mla, weight = layer.mla, layer.kv_b_proj.weight
    g = torch.Generator().manual_seed(0)
    ranges, times = [], []
    for limit, q in PREFILL_BUCKETS:
        length = 2 * q
        rand = lambda *shape: torch.randn(*shape, generator=g).to(weight)  # noqa: E731
        q_nope, q_pe = rand(q, layer.num_heads, mla.qk_nope_head_dim), rand(q, layer.num_heads, mla.qk_rope_head_dim)
        c_kv, k_pe = rand(length, mla.kv_lora_rank), rand(length, mla.qk_rope_head_dim)
        mask = _causal(q, length, weight.device)[None]
        with torch.inference_mode():
            ms = {"expanded": best_ms(layer.expanded, (q_nope, q_pe, c_kv, k_pe), rounds),
                  "absorbed": best_ms(lambda *a: layer.absorbed(*a), (q_nope[None], q_pe[None], c_kv[None],
                                                                       k_pe[None], mask), rounds)}
        ranges.append((limit, min(ms, key=ms.get)))
        times.append(ms)
    return PrefillForms(tuple(ranges), tuple(times))


def select_prefill_forms(model: nn.Module, tp: TPGroup) -> str | None:
    """Every MLA layer's prefill forms, timed once on the first layer (rank 0's times for every TP
    rank, so an instance runs one plan); returns the load log's line (None: no MLA layer)."""
    layers = [layer.self_attn for layer in model.layers if isinstance(layer.self_attn, MLAAttention)]
    if not layers:
        return None
    forms = tp.broadcast_object(time_prefill_forms(layers[0]))
    for layer in layers:
        layer.prefill_forms = forms
    return f"latent attention: decodes absorbed; prefills {forms.describe()}"
