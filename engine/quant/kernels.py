"""int8 kernels: weights quantized per output channel, symmetric.

    scale[n] = max_k |W[n, k]| / 127        qweight = round(W / scale[:, None]) in [-127, 127]

Two numerics, two linear methods (engine/quant/int8.py):

weight-only (`int8`): y ~= x @ (qweight * scale[:, None]).T, x in the model dtype
- `int8pack`: torch's `_weight_int8pack_mm` (vectorized for bf16/fp16 only; scalar in fp32).
- `reference`: plain torch, the weight dequantized on every call; the tests' reference and the
  fallback when no other kernel runs here.

dynamic int8 activations (`w8a8`): x is also quantized, per tensor to uint8, on every call
- `fbgemm`: `torch.ops.quantized.linear_dynamic` (x86), int8 x uint8 GEMM with int32
  accumulation. `reduce_range` (7-bit activations) unless the CPU has VNNI: without VNNI fbgemm
  sums pairs of u8 x s8 products in 16 bits (vpmaddubsw), which saturates at full range.
- `reference_w8a8`: plain torch on x quantized the same way; the fallback.
"""
from __future__ import annotations

import functools
import platform
import warnings
from abc import ABC, abstractmethod
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from engine.quant.base import UnquantizedLinearMethod

BASELINE = "unquantized"  # the kernel name selection times beside the candidates, for the log


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel.

    Args:
        weight: (out, in), any float dtype.
    Returns:
        qweight (out, in) int8 in [-127, 127], scale (out,) float32, with
        weight ~= qweight * scale[:, None] (error at most scale / 2 per element).
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (qweight.float() * scale[:, None]).to(dtype)  # (out, in)


class LinearKernel(ABC):
    """One way of computing `x @ W.T` from a quantized W: `prepare` takes the format's tensors
    (int8: qweight, scale; int4, engine/quant/int4.py: qweight, scales, mins), then the dtype."""

    name: str
    label: str  # for logs

    def unavailable(self, device: torch.device) -> str | None:
        """Why this kernel cannot run on `device` here, or None."""
        return None

    def unsupported(self, shape: tuple[int, int], dtype: torch.dtype) -> str | None:
        """Why this kernel cannot take a weight of `shape` (out, in) with `dtype` activations, or None."""
        return None

    @abstractmethod
    def prepare(self, *weights_and_dtype) -> Any:
        """Once per layer, `prepare(*weights, dtype)`: whatever `run` needs (a packed weight).
        dtype: the activations' dtype."""

    @abstractmethod
    def run(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, in) -> (num_tokens, out), in x's dtype, no bias."""


@functools.cache
def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class FbgemmKernel(LinearKernel):
    name, label = "fbgemm", "fbgemm linear_dynamic"

    def __init__(self, reduce_range: bool | None = None):
        self.reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range

    def unavailable(self, device):
        if device.type != "cpu":
            return f"a CPU kernel (device {device.type})"
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return f"x86 only (this is {platform.machine()})"
        if torch.backends.quantized.engine not in ("fbgemm", "x86"):
            return f"quantized engine is {torch.backends.quantized.engine}"
        return None

    def prepare(self, qweight, scale, dtype):
        zero = torch.zeros(scale.shape, dtype=torch.long)
        with warnings.catch_warnings():
            # NOTE: torch deprecates its quantized tensor type; the op still takes one. When it is
            # removed, prepare raises and selection skips this kernel with a log line.
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qt = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qt, None)

    def run(self, state, x):
        out = torch.ops.quantized.linear_dynamic(x.float(), state, self.reduce_range)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class Int8PackKernel(LinearKernel):
    name, label = "int8pack", "torch _weight_int8pack_mm"

    def unavailable(self, device):
        return None if hasattr(torch, "_weight_int8pack_mm") else "not in this torch build"

    def unsupported(self, shape, dtype):
        # NOTE: torch's vectorized bf16/fp16 CPU kernel reads 16 elements per step with aligned
        # loads and checks neither; in_features % 16 != 0 crashes the process (seen: in=40).
        if dtype != torch.float32 and shape[1] % 16:
            return f"in_features {shape[1]} is not a multiple of 16 ({dtype} needs aligned 16-wide loads)"
        return None

    def prepare(self, qweight, scale, dtype):
        return qweight, scale.to(dtype)

    def run(self, state, x):
        qweight, scale = state
        if x.dtype != torch.float32 and (not x.is_contiguous() or x.data_ptr() % 64):
            x = x.clone(memory_format=torch.contiguous_format)  # a fresh buffer is 64-byte aligned
        return torch._weight_int8pack_mm(x, qweight, scale)


class ReferenceKernel(LinearKernel):
    name, label = "reference", "plain torch (dequantize per call)"

    def prepare(self, qweight, scale, dtype):
        return qweight, scale

    def run(self, state, x):
        return F.linear(x, dequantize(*state, x.dtype))


class ReferenceW8A8Kernel(LinearKernel):
    """fbgemm's numerics in plain torch: x quantized per tensor to uint8 (asymmetric, zero
    included in the range; 7-bit with reduce_range) and dequantized, times the dequantized weight."""

    name, label = "reference_w8a8", "plain torch (activations quantized per call)"

    def __init__(self, reduce_range: bool | None = None):
        self.reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range

    def prepare(self, qweight, scale, dtype):
        return qweight, scale

    def run(self, state, x):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")  # see FbgemmKernel
            xq = torch.quantize_per_tensor_dynamic(x.float(), torch.quint8, self.reduce_range).dequantize()
        return F.linear(xq, dequantize(*state, torch.float32)).to(x.dtype)


class UnquantizedBaseline(LinearKernel):
    """What `quantization: none` would run (F.linear, or oneDNN-packed bf16): timed beside the
    int8 kernels for the log only."""

    name, label = BASELINE, "unquantized"

    def prepare(self, qweight, scale, dtype):
        return self.unquantized_state(dequantize(qweight, scale, dtype))

    @staticmethod
    def unquantized_state(weight: torch.Tensor) -> SimpleNamespace:
        """What the unquantized method keeps for a float (out, in) weight (packed on a CPU)."""
        layer = SimpleNamespace(weight=weight)
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        return layer

    def run(self, state, x):
        return UnquantizedLinearMethod().apply(state, x, None)


KERNELS = {k.name: k for k in (FbgemmKernel, Int8PackKernel, ReferenceKernel, ReferenceW8A8Kernel)}


