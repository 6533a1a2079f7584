"""The LM head from a GGUF's Q8_0 blocks, as two exact int4 planes, where that is faster.

A Q4 GGUF (llama.cpp's default files) stores the LM head, or the tied embedding, as Q8_0: per
block of 32 weights one fp16 scale `s` and 32 int8 codes `q`. Read as bf16 the head is 2 bytes
a weight, SmolLM2's 49152 x 576 is 57 MB a step, and a batch-1 step reads it all: 3.3 ms of
~12 here. No CPU kernel here multiplies group-wise int8, but each code splits exactly into
4-bit halves, `q = 16 hi + lo` (hi = floor(q / 16) in -8..7, lo in 0..15), so

    s q = (16 s) hi + s lo

is the sum of two group-wise int4 matrices, each a `_weight_int4pack_mm_for_cpu` (scales and
zeros in the activations' dtype, as for the decoder's int4): 35 MB instead of 57, 2.0 vs 3.3 ms at one
token. The planes only win at a token or two (the int4 kernel is arithmetic-bound from a few
rows), so like the decoder's kernels the choice is measured per batch-size range at load
(engine/quant/selection.py), against the head dequantized to bf16 and packed for oneDNN.
Numerics: each plane rounds once to bf16 before the sum, so logits differ from the dense bf16
head's by about one bf16 rounding (tests/engine/quant/test_q8_head.py).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from engine.quant.base import BaseLinearMethod, LinearKernel, UnquantizedBaseline
from engine.quant.integer import Int4PackKernel, skip_kernel
from engine.quant.q4 import GROUP_SIZE
from engine.quant.selection import KernelChoice, choose_kernels

logger = logging.getLogger(__name__)

Q8_0_BLOCK_BYTES = 2 + GROUP_SIZE  # fp16 scale, 32 int8 codes
_INT4 = Int4PackKernel()  # each plane's kernel (stateless)


def decode_q8_0_blocks(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (one row of blocks per output row) as codes (out, in) int8 and scales (out,
    in / 32) float32: weight = code x scale."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP_SIZE, Q8_0_BLOCK_BYTES)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales))


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = codes.shape
    return (codes.float().view(rows, -1, GROUP_SIZE) * scales.unsqueeze(-1)).view(rows, cols).to(dtype)


def int4_planes(codes: torch.Tensor, scales: torch.Tensor):
    """The two planes as Q4_1-style (codes 0..15, scales, mins) with q4 x scale + min: hi + 8
    at scale 16 s and min -128 s; lo at scale s and min 0."""
    wide = codes.to(torch.int16)
    hi = torch.div(wide, 16, rounding_mode="floor")
    lo = wide - 16 * hi
    high = ((hi + 8).to(torch.uint8), 16 * scales, -128 * scales)
    return high, (lo.to(torch.uint8), scales, torch.zeros_like(scales))


class Q8Int4PlanesKernel(LinearKernel):
    name, label = "q8_0_int4_planes", "Q8_0 as two int4pack planes"

    def unavailable(self, device):
        return _INT4.unavailable(device)

    def unsupported(self, shape, dtype):
        if dtype != torch.bfloat16:
            return f"int4pack has no vectorized {str(dtype).removeprefix('torch.')} path"
        return _INT4.unsupported(shape, dtype)

    def prepare(self, codes, scales, dtype):
        return tuple(_INT4.prepare(*plane, dtype) for plane in int4_planes(codes, scales))

    def run(self, state, x):
        hi, lo = state
        return _INT4.run(hi, x) + _INT4.run(lo, x)

    def state_tensors(self, state):
        hi, lo = state
        return [*hi, *lo]

    def restore(self, tensors):
        return tuple(tensors[:2]), tuple(tensors[2:])


class DequantizedQ8Kernel(UnquantizedBaseline):
    name, label = "dequantized", "dequantized at load"

    def prepare(self, codes, scales, dtype):
        return self.unquantized_state(dequantize_q8_0(codes, scales, dtype))


def random_q8_0(shape: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in the kernels' format to time them on."""
    codes = torch.randint(-128, 128, shape, dtype=torch.int8, device=device)
    return codes, torch.rand(shape[0], shape[1] // GROUP_SIZE, device=device) * 0.01 + 1e-3


class Q8HeadMethod(BaseLinearMethod):
    """The LM head's kernels chosen per batch-size range between the Q8_0 planes and the head
    dequantized once (`codes`, `scales`: the file's blocks, this rank's rows)."""

    name = "q8_0 head"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.codes, self.scales, self.dtype = codes, scales, dtype
        self.kernels = {k.name: k for k in (Q8Int4PlanesKernel(), DequantizedQ8Kernel())}
        self.choices: list[KernelChoice] = []

    def create_weights(self, layer, input_size, output_size, weight_loader) -> None:
        raise NotImplementedError("the head's weight is the embedding's or the checkpoint's; set after loading")

    def process_layers(self, layers) -> None:
        (layer,) = layers
        device = layer.weight.device
        shape = tuple(self.codes.shape)
        usable = [k for k in self.kernels.values() if not skip_kernel(self.name, k, device, [shape], self.dtype)]
        self.choices = choose_kernels([shape], usable, self.dtype, device,
                                      fallback=self.kernels["dequantized"], random_weights=random_q8_0)
        names = list(dict.fromkeys(c.kernel for c in self.choices))  # each kernel once, whatever ranges it runs
        name = getattr(layer, "layer_name", "lm_head")
        store = None if self.prepared is None else self.prepared.open(self.name, {}, {name: shape}, self.kernels,
                                                                      self.choices)
        states = store.states(name, names) if store is not None else None
        if states is None:
            codes, scales = self.codes.to(device), self.scales.to(device)
            states = {n: self.kernels[n].prepare(codes, scales, self.dtype) for n in names}
            if store is not None:
                store.keep(name, states)
        if store is not None:
            store.finish()
        layer.quant_state = states
        self.codes = self.scales = None  # prepared; the embedding keeps its own (dense) copy

    def apply(self, layer, x, bias) -> torch.Tensor:
        name = next(c.kernel for c in self.choices if c.max_m is None or x.shape[0] <= c.max_m)
        out = self.kernels[name].run(layer.quant_state[name], x)
        return out if bias is None else out + bias

    def describe(self, layers) -> str:
        ranges = "; ".join(c.describe(self.kernels[c.kernel].label) for c in self.choices)
        return f"LM head from the GGUF's Q8_0 blocks ({str(self.dtype).removeprefix('torch.')}): {ranges}"


def gguf_q8_0_head(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LM head's Q8_0 blocks as codes (vocab, hidden) int8 and scales (vocab, hidden / 32)
    fp32 (engine/quant/q8_head.py): `output.weight`, or the embedding it is tied to; None when
    that tensor is not Q8_0."""
    from engine.quant.gguf_file import open_gguf  # gguf is needed for GGUF files only
    tensors = {t.name: t for t in open_gguf(path).tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is None or head.tensor_type.name != "Q8_0":
        return None
    return decode_q8_0_blocks(head.data, tuple(int(d) for d in reversed(head.shape)))


def q8_head_method(path, decoder: BaseLinearMethod, dtype: torch.dtype, device: torch.device,
                   tp_size: int) -> Q8HeadMethod | None:
    """The Q8_0 head where the decoder keeps a Q4 GGUF's own blocks (quantization auto / int4) and
    the file's head is Q8_0; None (logged why, when it would have applied) elsewhere."""
    if not getattr(decoder, "prequantized", False):
        return None
    why = ("a CPU kernel" if device.type != "cpu" else
           "tensor-parallel ranks keep their vocabulary slice dense" if tp_size > 1 else
           f"its int4 planes run bf16 activations, not {str(dtype).removeprefix('torch.')}"
           if dtype != torch.bfloat16 else None)
    head = None if why else gguf_q8_0_head(path)
    if why is None and head is None:
        why = "the file's head is not Q8_0"
    if why is not None:
        logger.info("LM head: dequantized (%s)", why)
        return None
    return Q8HeadMethod(*head, dtype)
