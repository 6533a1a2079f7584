"""A layer's experts, stacked (engine/layers/moe.py's SparseMoeBlock holds one): their weights as loaded,
sliced for tensor or expert parallelism, and which expert method or quantized kernel computes them.

    experts = FusedExperts(num_experts, hidden, inter, tp, held)   # held: expert parallelism's share
    experts.weight_loader(experts.w13_weight, gate, expert=5, shard=0)  # one checkpoint tensor
    experts.quantize("int4", dtype)                                # --quantization int4 (optional)
    out = experts(x, weights, ids)                                 # this rank's partial sum
"""
from __future__ import annotations

import torch
from torch import nn

from engine.core.choices import MethodChoice
from engine.core.expert_placement import HeldExperts
from engine.layers.expert_compute import ACTIVATIONS, METHODS, PACKED, LocalExperts, sort_pairs, vllm_cpu_experts
from engine.parallel.layers import TPGroup
from engine.layers.quant_experts import (FORMATS, QuantizedExperts, q4_experts, quantize_experts, quantized_experts,
                                         time_kernels)
from engine.quant.q4 import GROUP_SIZE

# with q4_codes, in place of w13_weight and w2_weight
Q4_PARAMS = ("w13_qweight", "w13_scales", "w13_mins", "w2_qweight", "w2_scales", "w2_mins")


class FusedExperts(nn.Module):
    """A layer's experts, stacked: under tensor parallelism every expert, this rank's slice of each
    one's intermediate dimension; under expert parallelism (`held`) whole experts, this rank's.
    With `bias`, w13_bias (num_local, 2 * inter) and w2_bias (num_local, hidden) beside them.
    With `q4_codes` (a GGUF's Q4 experts, read as they are), in place of w13_weight and w2_weight
    their codes and per-group scales and minimums: w13_qweight (num_local, 2 * inter, hidden)
    uint8, w13_scales and w13_mins (num_local, 2 * inter, hidden / 32), and w2's alike."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 held: HeldExperts | None = None, bias: bool = False, activation: str = "silu",
                 q4_codes: bool = False):
        """held: the experts this rank holds (expert parallelism); None: all, split by TP.
        activation: an engine/layers/expert_compute.py ACTIVATIONS name ("swigluoai": interleaved rows)."""
        super().__init__()
        assert activation in ACTIVATIONS, activation
        self.tp, self.num_experts, self.held, self.activation = tp, num_experts, held, activation
        split = 1 if held is not None else tp.size
        assert intermediate_size % split == 0, f"{intermediate_size} does not split over {split} ranks"
        self.inter = intermediate_size // split
        self.start = 0 if held is not None else tp.rank * self.inter  # this rank's first row of each expert
        self.local = None if held is None else LocalExperts.of(held, num_experts, torch.get_default_device())
        self.choice = MethodChoice(((None, "loop"),))  # the model runner measures and sets it (select_expert_methods)
        self.quant: QuantizedExperts | None = None  # set by quantize
        self.num_local = num_local = num_experts if held is None else len(held.ids)
        shapes = {"w13": (num_local, 2 * self.inter, hidden_size), "w2": (num_local, hidden_size, self.inter)}
        self.w13_weight = self.w2_weight = self.w13_qweight = None
        for stack, (e, rows, cols) in shapes.items():
            if not q4_codes:
                self._stacked(f"{stack}_weight", (e, rows, cols))
                continue
            self._stacked(f"{stack}_qweight", (e, rows, cols), torch.uint8)
            self._stacked(f"{stack}_scales", (e, rows, cols // GROUP_SIZE), torch.float32)
            self._stacked(f"{stack}_mins", (e, rows, cols // GROUP_SIZE), torch.float32)
        self.w13_bias = self.w2_bias = None
        if bias:
            self._stacked("w13_bias", (num_local, 2 * self.inter))
            self._stacked("w2_bias", (num_local, hidden_size))

    def _stacked(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader, param.stack = self.weight_loader, name.split("_")[0]  # stack: "w13" or "w2"
        setattr(self, name, param)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, expert: int, shard: int | None = None) -> None:
        """full: one expert's checkpoint tensor, (inter, hidden) for gate (shard 0) and up (shard 1),
        (hidden, inter) for down (Q4 scales and minimums: a column per group); this rank's rows
        (gate, up) or columns (down) copied in, nothing for an expert another rank holds."""
        if self.held is not None and expert not in self.held.ids:
            return
        index, n = expert if self.held is None else self.held.ids.index(expert), self.inter
        if param.stack == "w13":
            param.data[index].narrow(0, shard * n, n).copy_(full.narrow(0, self.start, n))
        else:  # this rank's columns: of the weights, or of their groups of 32
            cols = param.shape[2]
            param.data[index].copy_(full.narrow(1, self.start // n * cols, cols))

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
        if param.stack == "w13":  # the weights' rows and the bias's entries
            param.data.copy_(full.narrow(1, 2 * self.start, 2 * n))
        elif param.dim() == 3:
            param.data.copy_(full.narrow(2, self.start, n))
        elif self.held is not None or self.tp.rank == 0:
            param.data.copy_(full)
        else:
            param.data.zero_()

    def quantize(self, scheme: str, dtype: torch.dtype, ms: dict[str, float] | None = None) -> None:
        """Quantized experts (engine/layers/quant_experts.py): "int8" per output channel (--quantization
        int8 or w8a8), "int4" (--quantization int4, or a Q4 GGUF's own codes), prepared for the
        kernel fastest in `ms` (`kernel_times`; None: timed here), which runs every batch; the float
        weights (or the loaded codes) are dropped. dtype: the activations' (the model's)."""
        if self.w13_qweight is not None:
            assert scheme == "int4", scheme
            self.quant = q4_experts(*self._codes(), dtype, ms)
            for name in Q4_PARAMS:
                setattr(self, name, None)
        else:
            self.quant = quantize_experts(scheme, self.w13_weight.data, self.w2_weight.data, ms)
            self.w13_weight = self.w2_weight = None
        self.choice = MethodChoice(((None, scheme),))

    def kernel_times(self, scheme: str, dtype: torch.dtype) -> dict[str, float]:
        """Each quantized kernel's time on this layer's first expert pair (engine/layers/quant_experts.py)."""
        if self.w13_qweight is not None:
            first13, first2 = (tuple(p[0] for p in codes) for codes in self._codes())
        else:
            first13, first2 = (FORMATS[scheme][0](w.data[0]) for w in (self.w13_weight, self.w2_weight))
        return time_kernels(scheme, first13, first2, dtype)

    def _codes(self) -> list[tuple[torch.Tensor, ...]]:
        """(qweight, scales, mins) of w13, then of w2, as loaded."""
        return [tuple(getattr(self, name).data for name in Q4_PARAMS[i:i + 3]) for i in (0, 3)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the chosen experts' outputs, (num_tokens, hidden)."""
        method = self.choice.method(x.shape[0])
        extra = (self.w13_bias, self.w2_bias, self.activation)
        if method == PACKED:  # w13/w2 hold vLLM-CPU's packed layout (select_expert_methods)
            return vllm_cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids, *extra)
        pairs = sort_pairs(ids, weights, self.num_local, self.local)
        if self.quant is not None:
            return quantized_experts(x, self.quant, pairs, *extra)
        return METHODS[method](x, self.w13_weight, self.w2_weight, pairs, *extra)
