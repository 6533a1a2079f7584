"""Quantized experts: a mixture's expert weights in int8 or int4, each expert's two GEMMs through one
linear kernel (engine/quant/base.py, engine/quant/integer.py), the fastest of those that run here,
timed at load on the first expert pair.

    quant = quantize_experts("int8", w13, w2)          # --quantization int8 / w8a8: per output channel
    quant = quantize_experts("int4", w13, w2)          # --quantization int4: gguf's Q4_1 of the weights
    quant = q4_experts(codes13, codes2, dtype)         # a GGUF's Q4 `ffn_*_exps` as they are
    out = quantized_experts(x, quant, pairs, b13, b2, act)   # as engine/layers/expert_compute.py loop_experts

The activations stay in the model's dtype, but for one candidate: where that is fp32, each packed
kernel is also timed on bf16 activations (`OnBf16`, named `<kernel>_bf16`). torch's int8pack and
int4pack CPU kernels are scalar for fp32 activations and vectorized for bf16 (on an AVX2 EPYC, a
(1536, 2048) expert GEMM at 8 tokens: int8pack 12.5 ms on fp32, 0.59 ms on bf16, fp32 F.linear
1.6 ms). Rounding the activations to bf16 (relative 2^-9) adds little to the weights' own
rounding (int8: up to 2^-8 of a row's largest weight; int4: 1/30 of a group's range).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.expert_compute import ACTIVATIONS, Pairs, best_ms, by_expert
from engine.quant.integer import Int4PackKernel, ReferenceInt4Kernel
from engine.quant.base import Int8PackKernel, LinearKernel, ReferenceKernel, dequantize, quantize_per_channel
from engine.quant.q4 import GROUP_SIZE, dequantize_q4, quantize_q4_1

logger = logging.getLogger(__name__)

TIMED_TOKENS = 8  # an expert's pairs in a decode step of a few dozen sequences
# scheme -> (quantize a float (out, in) weight into the format's tensors, dequantize them, the log's words)
FORMATS = {"int8": (quantize_per_channel, dequantize, "int8 per output channel"),
           "int4": (quantize_q4_1, dequantize_q4, f"int4 group-wise ({GROUP_SIZE} per group)")}


KERNEL_PAIRS = {"int8": (Int8PackKernel, ReferenceKernel), "int4": (Int4PackKernel, ReferenceInt4Kernel)}


class OnBf16(LinearKernel):
    """A packed kernel on bf16 activations, for an fp32 model: x rounded to bf16 going in, the
    output cast back to fp32."""

    def __init__(self, inner: LinearKernel):
        self.inner = inner
        self.name, self.label = f"{inner.name}_bf16", f"{inner.label} on bf16 activations"

    def unavailable(self, device):
        return self.inner.unavailable(device)

    def unsupported(self, shape, dtype):
        if dtype != torch.float32:
            return f"the activations are {dtype} already"
        return self.inner.unsupported(shape, torch.bfloat16)

    def prepare(self, *weights_and_dtype):
        return self.inner.prepare(*weights_and_dtype[:-1], torch.bfloat16)

    def run(self, state, x):
        return self.inner.run(state, x.to(torch.bfloat16)).to(x.dtype)


def candidates(scheme: str) -> tuple[LinearKernel, ...]:
    """The kernels timed for a scheme: its packed kernel, on the model's activations and on bf16
    ones, and the plain-torch reference (dequantizing each expert per call; it runs anywhere)."""
    packed, reference = KERNEL_PAIRS[scheme]
    return packed(), OnBf16(packed()), reference()


@dataclass
class QuantizedExperts:
    """A layer's quantized experts: per local expert, the kernel's prepared (gate/up, down) weights."""

    scheme: str  # a FORMATS key
    kernel: LinearKernel
    states: list[tuple[Any, Any]]
    ms: dict[str, float]  # an expert pair at TIMED_TOKENS tokens: each kernel that ran, and "float" (F.linear)
    error: float | None = None  # relative error of the weights quantized here (None: the checkpoint's codes)

    def describe(self) -> str:
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in self.ms.items())
        source = ("the checkpoint's codes" if self.error is None else
                  f"quantized at load, relative error {self.error:.4f}")
        return (f"{FORMATS[self.scheme][2]} ({source}), kernel {self.kernel.name} (an expert pair at {TIMED_TOKENS} "
                f"tokens: {times})")


def quantize_experts(scheme: str, w13: torch.Tensor, w2: torch.Tensor, ms: dict[str, float] | None = None,
                     kernels=None) -> QuantizedExperts:
    """Float experts, w13 (E, 2 * inter, hidden) and w2 (E, hidden, inter), quantized expert by
    expert (int8: symmetric per output channel; int4: llama.cpp's Q4_1, groups of 32 inputs).
    ms, kernels: as `prepare_experts`."""
    quantize, dequant, _ = FORMATS[scheme]
    parts13, parts2 = [quantize(w) for w in w13], [quantize(w) for w in w2]
    diff = sum((dequant(*p, torch.float32) - w.float()).square().sum() for ws, ps in ((w13, parts13), (w2, parts2))
               for w, p in zip(ws, ps))
    error = (diff / (w13.float().square().sum() + w2.float().square().sum()).clamp_min(1e-30)).sqrt().item()
    return prepare_experts(scheme, parts13, parts2, w13.dtype, ms, kernels, error)


def q4_experts(codes13: tuple[torch.Tensor, ...], codes2: tuple[torch.Tensor, ...], dtype: torch.dtype,
               ms: dict[str, float] | None = None, kernels=None) -> QuantizedExperts:
    """Experts held as Q4 codes, as a GGUF stores them (engine/quant/q4.py): codes13 = (qweight (E,
    2 * inter, hidden) uint8, scales, mins (E, 2 * inter, hidden / 32) float32), codes2 alike."""
    return prepare_experts("int4", list(zip(*codes13)), list(zip(*codes2)), dtype, ms, kernels)


def prepare_experts(scheme: str, parts13: list[tuple], parts2: list[tuple], dtype: torch.dtype,
                    ms: dict[str, float] | None = None, kernels=None, error: float | None = None) -> QuantizedExperts:
    """Per expert, its format's tensors (parts13[e] gate/up, parts2[e] down) prepared for the
    kernel of `kernels` (default `candidates(scheme)`) fastest in `ms` (`time_kernels`: taken once
    for every layer; None: timed here on the first expert pair)."""
    kernels = {k.name: k for k in kernels or candidates(scheme)}
    if ms is None:
        ms = time_kernels(scheme, parts13[0], parts2[0], dtype, kernels.values())
    kernel = kernels[min((name for name in ms if name in kernels), key=ms.get)]
    states = [(kernel.prepare(*a, dtype), kernel.prepare(*b, dtype)) for a, b in zip(parts13, parts2)]
    return QuantizedExperts(scheme, kernel, states, ms, error)


def time_kernels(scheme: str, first13: tuple, first2: tuple, dtype: torch.dtype, kernels=None) -> dict[str, float]:
    """One expert pair's time at TIMED_TOKENS tokens (first13, first2: its format's tensors) through
    each of `kernels` (default `candidates(scheme)`) that runs here and takes both shapes, and
    through F.linear on its dequantized weights ("float", for the log)."""
    shape13, shape2 = tuple(first13[0].shape), tuple(first2[0].shape)
    device = first13[0].device
    x = torch.randn(TIMED_TOKENS, shape13[1], generator=torch.Generator().manual_seed(0)).to(device, dtype)
    ms = {}
    for kernel in kernels or candidates(scheme):
        why = kernel.unavailable(device) or kernel.unsupported(shape13, dtype) or kernel.unsupported(shape2, dtype)
        if why is not None:
            logger.info("%s experts: kernel %s cannot run (%s)", scheme, kernel.name, why)
            continue
        states = (kernel.prepare(*first13, dtype), kernel.prepare(*first2, dtype))
        ms[kernel.name] = best_ms(_pair(kernel.run, states, shape2[1]), (x,), 5)
    if list(ms) == ["reference"]:
        logger.warning("%s experts: only the reference kernel runs here (each expert dequantized on every call)",
                       scheme)
    dequant = FORMATS[scheme][1]
    floats = (dequant(*first13, dtype), dequant(*first2, dtype))
    ms["float"] = best_ms(_pair(lambda w, v: F.linear(v, w), floats, shape2[1]), (x,), 5)
    best = min((name for name in ms if name != "float"), key=ms.get)
    if ms[best] > ms["float"]:
        logger.warning("%s experts: the fastest kernel (%s, %.2f ms) is slower than F.linear on the dequantized "
                       "weights (%.2f ms) for an expert pair at %d tokens: %s saves weight memory here, not time",
                       scheme, best, ms[best], ms["float"], TIMED_TOKENS, scheme)
    return ms


def _pair(run, states, inter: int):
    """One expert's two GEMMs (the activation's halving stood in for by a slice), for timing."""
    return lambda x: run(states[1], run(states[0], x)[:, :inter])


def quantized_experts(x: torch.Tensor, quant: QuantizedExperts, pairs: Pairs, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """As engine/layers/expert_compute.py `loop_experts`, each expert's GEMMs through the quantized kernel."""
    def expert_out(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = quant.states[e]
        h = quant.kernel.run(gate_up, rows)
        y = quant.kernel.run(down, ACTIVATIONS[act](h if b13 is None else h + b13[e]))
        return y if b2 is None else y + b2[e]
    return by_expert(x, pairs, expert_out)
