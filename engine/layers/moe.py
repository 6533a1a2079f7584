"""The mixture-of-experts MLP: a router picks `top_k` experts per token, the experts run grouped
by expert, and their outputs are summed with the router's weights.

    block = SparseMoeBlock(cfg, tp)                 # cfg.moe: engine/core/config.py MoEConfig
    out = block(hidden)                             # (num_tokens, hidden_size), reduced over TP ranks

The experts of a layer are stored stacked, `w13_weight (num_experts, 2 * inter, hidden)` ([gate |
up] rows, as the dense MLP's gate_up_proj) and `w2_weight (num_experts, hidden, inter)`, loaded from
per-expert checkpoint tensors (`experts.{e}.gate_proj.weight` or Mixtral's `w1/w3/w2`). Tensor
parallelism splits every expert's intermediate dimension: each rank's product is a partial sum,
reduced once per layer together with the shared expert's (Qwen2-MoE).

Each block counts the tokens routed to each of its experts (`expert_counts`) for the load metrics.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.config import ModelConfig
from engine.core.expert_placement import HeldExperts, imbalance, rank_loads
from engine.layers.common import silu_and_mul
from engine.layers.expert_compute import METHODS, PACKED, LocalExperts, select_method, sort_pairs, vllm_cpu_pack
from engine.layers.fused_experts import FusedExperts
from engine.layers.routing import route, route_tokens
from engine.parallel.layers import MergedColumnParallelLinear, RowParallelLinear, TPGroup
from engine.quant import experts_read_q4_codes
from engine.quant.base import BaseLinearMethod

__all__ = ["FusedExperts", "Router", "SharedExpert", "SparseMoeBlock", "expert_param", "grouped_experts", "route"]


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, local: LocalExperts | None = None, method: str = "loop") -> torch.Tensor:
    """The experts' weighted sum (engine/layers/expert_compute.py), pairs grouped by expert.

    Args:
        x: (num_tokens, hidden).
        w13: (num_local, 2 * inter, hidden), [gate | up] rows; w2: (num_local, hidden, inter).
        weights: (num_tokens, top_k) float32; ids: (num_tokens, top_k), each in 0..num_experts-1.
        local: expert parallelism's lookups (which experts are in w13/w2, a replica's share of its
            tokens); None: every expert, in id order.
        method: a name of engine/layers/expert_compute.py METHODS.

    Returns:
        (num_tokens, hidden) in x's dtype.
    """
    return METHODS[method](x, w13, w2, sort_pairs(ids, weights, w13.shape[0], local))


class Router(nn.Module):
    """The router's linear, (num_experts, hidden), unquantized and replicated on every rank; with
    `bias` (gpt-oss) a bias too. DeepSeek's (`fp32`) computes in float32 whatever the model's dtype,
    as its checkpoints keep it, and V3's carries `e_score_correction_bias` (`correction`: added to
    the scores the experts are chosen on, not to their weights: engine/layers/routing.py)."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False, fp32: bool = False,
                 correction: bool = False):
        super().__init__()
        dtype = torch.float32 if fp32 else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.e_score_correction_bias = None
        if correction:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)  # (num_tokens, num_experts)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert, a dense SwiGLU MLP whose down projection leaves its partial sum
    to the block."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 linear_method: BaseLinearMethod | None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp,
                                                       linear_method=linear_method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, linear_method=linear_method,
                                           reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: router (engine/layers/routing.py), experts, and a shared expert (Qwen2-MoE's
    gated by a sigmoid, DeepSeek's not); one all-reduce of their summed partial outputs."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 held: HeldExperts | None = None):
        """held: the experts this rank holds under expert parallelism; None: tensor parallelism."""
        super().__init__()
        self.moe = moe = cfg.moe
        self.tp, self.top_k, self.renormalize = tp, moe.top_k, moe.renormalize
        deepseek = moe.routing != "softmax" or not moe.shared_expert_gate
        self.gate = Router(moe.num_experts, cfg.hidden_size, moe.router_bias, fp32=deepseek,
                           correction=moe.routing == "noaux_tc")
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp, held,
                                    moe.expert_bias, moe.activation, q4_codes=experts_read_q4_codes(linear_method))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_intermediate_size, tp, linear_method)
            if moe.shared_expert_gate:
                self.shared_expert_gate = Router(1, cfg.hidden_size)
        # tokens routed to each expert since the last reset (every slot of top_k counts)
        self.register_buffer("expert_counts", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden), the same on every TP rank."""
        weights, ids = route_tokens(self.gate(x), self.moe, self.gate.e_score_correction_bias)
        self.expert_counts += torch.bincount(ids.flatten(), minlength=self.expert_counts.shape[0])
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


# checkpoint name of one expert's tensor -> (stack, shard): Qwen's and Mixtral's spellings; a float
# weight, or (a GGUF's Q4 experts, engine/loading/gguf_loader.py) its codes, scales or minimums
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.)experts\.(?P<expert>\d+)\.(?P<proj>\w+)\."
                           r"(?P<kind>weight|qweight|scales|mins)$")
EXPERT_SHARDS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                 "down_proj": ("w2", None), "w2": ("w2", None)}


def expert_param(name: str) -> tuple[str, tuple] | None:
    """`layers.0.mlp.experts.5.up_proj.weight` -> ("layers.0.mlp.experts.w13_weight", (5, 1)): the
    stacked parameter and the loader's arguments; None for a tensor that is not one expert's."""
    m = EXPERT_TENSOR.match(name)
    if m is None or m["proj"] not in EXPERT_SHARDS:
        return None
    stack, shard = EXPERT_SHARDS[m["proj"]]
    expert = int(m["expert"])
    return f"{m['prefix']}experts.{stack}_{m['kind']}", (expert,) if shard is None else (expert, shard)


def moe_blocks(model: nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    """(layer index, block) of every sparse layer, in order."""
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


def select_expert_methods(model: nn.Module, name: str) -> None:
    """The expert method of every sparse block: `name`, or for "auto" the fastest per batch size,
    measured once on the first block's weights (all blocks are alike). Under TP every rank
    measures and rank 0's choice is taken by all, so an instance runs one method whatever the
    noise in each rank's timings."""
    blocks = moe_blocks(model)
    if not blocks:
        return
    if (quant := blocks[0][1].experts.quant) is not None:  # its kernel was timed when quantizing
        if name != "auto":
            raise ValueError(f"--expert-method {name} runs float experts; {quant.scheme} experts (--quantization "
                             f"{quant.scheme}{' or w8a8' if quant.scheme == 'int8' else ''}) run their own kernel: "
                             "use --expert-method auto")
        return
    first = blocks[0][1]
    experts = first.experts
    choice = select_method(name, experts.w13_weight, experts.w13_weight, experts.w2_weight, first.top_k, experts.local,
                           b13=experts.w13_bias, b2=experts.w2_bias, act=experts.activation)
    choice = first.tp.broadcast_object(choice)
    for _, block in blocks:
        block.experts.choice = choice
        if choice.method(1) == PACKED:  # its own layout, in place of the loaded one (no second copy)
            block.experts.w13_weight.data = vllm_cpu_pack(block.experts.w13_weight.data)
            block.experts.w2_weight.data = vllm_cpu_pack(block.experts.w2_weight.data)


def describe_experts(model: nn.Module) -> str | None:
    """One line for the load log: what computes the experts; None for a dense model."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    experts = blocks[0][1].experts
    if experts.held is None:
        split = f"tensor-parallel: each expert's intermediate {experts.inter} of {experts.inter * experts.tp.size}"
    else:
        replicas = sum(n > 1 for _, n in experts.held.replica)
        split = (f"expert-parallel: {len(experts.held.ids)} whole experts here in layer {blocks[0][0]} "
                 f"({replicas} shared with other ranks), one all-reduce of the partial sums per layer")
    if experts.quant is not None:
        weights = experts.quant.describe()
    else:
        weights = f"{experts.w13_weight.dtype} unquantized"
    return (f"{experts.choice.describe()}; {len(blocks)} sparse layers of {experts.num_experts} experts, "
            f"{weights}; {split}")


EXPERT_SCHEME = {"int8": "int8", "w8a8": "int8", "int4": "int4"}  # linear method -> its experts' (weights only)


def quantize_model_experts(model: nn.Module, method: str, dtype: torch.dtype) -> None:
    """The experts of every sparse block quantized as the linear method's weights are (int8 for
    int8 and w8a8, int4 for int4; their activations stay in the model's `dtype`); other methods
    leave them unquantized (said in the load log by `describe_experts`). The kernel is timed once,
    on the first block, and under TP rank 0's times are taken by all (one kernel per instance)."""
    blocks = moe_blocks(model)
    if method not in EXPERT_SCHEME or not blocks:
        return
    scheme, first = EXPERT_SCHEME[method], blocks[0][1]
    ms = first.tp.broadcast_object(first.experts.kernel_times(scheme, dtype))
    for _, block in blocks:
        block.experts.quantize(scheme, dtype, ms)


def expert_counts(model: nn.Module) -> dict[int, list[int]]:
    """Per sparse layer, the tokens routed to each expert since the counts were last reset."""
    return {layer: block.expert_counts.tolist() for layer, block in moe_blocks(model)}


def reset_expert_counts(model: nn.Module) -> None:
    for _, block in moe_blocks(model):
        block.expert_counts.zero_()


def expert_load_figures(model: nn.Module) -> dict[str, float]:
    """The load report's expert figures (flat, as every load figure): per sparse layer L,
    `expert_imbalance/L`, max over mean of the tokens per expert (how skewed the routing is), and
    under expert parallelism `expert_rank_imbalance/L`, max over mean of the tokens per rank (how
    much longer the busiest rank computes than an even split: what a placement plan lowers)."""
    out = {}
    for layer, block in moe_blocks(model):
        counts = block.expert_counts.tolist()
        out[f"expert_imbalance/{layer}"] = imbalance([float(c) for c in counts])
        if (held := block.experts.held) is not None:
            out[f"expert_rank_imbalance/{layer}"] = imbalance(rank_loads(counts, held.layer_ranks))
    return out
