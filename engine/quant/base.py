"""The linear-method interface and the unquantized method; the kernel interface and the int8 kernels.

A linear layer (engine/parallel/layers.py) owns its shapes, its sharding and its collectives; its
*linear method* owns how the weight is stored and multiplied (vLLM's `LinearMethodBase`):

    method.create_weights(layer, ...)          # at construction: the parameters checkpoints load into
    model.load_weights(...)                    # each rank copies its own shard in (weight_loader)
    method.process_layers(layers)              # once, after loading: pack, quantize, pick kernels
    y = method.apply(layer, x, bias)           # every forward

Kernels (`LinearKernel`): int8 weights quantized per output channel, symmetric.

    scale[n] = max_k |W[n, k]| / 127        qweight = round(W / scale[:, None]) in [-127, 127]

Two numerics, two linear methods (engine/quant/integer.py):

weight-only (`int8`): y ~= x @ (qweight * scale[:, None]).T, x in the model dtype
- `int8pack`: torch's `_weight_int8pack_mm` (vectorized for bf16/fp16 only; scalar in fp32).
- `reference`: plain torch, the weight dequantized on every call; the tests' reference and the
  fallback when no other kernel runs here.

dynamic int8 activations (`w8a8`): x is also quantized, per tensor to uint8, on every call
- `fbgemm`: `torch.ops.quantized.linear_dynamic` (x86), int8 x uint8 GEMM with int32
  accumulation. `reduce_range` (7-bit activations) unless the CPU has VNNI: without VNNI fbgemm
  sums pairs of u8 x s8 products in 16 bits (vpmaddubsw), which saturates at full range.
- `reference_w8a8`: plain torch on x quantized the same way; the fallback."""
from __future__ import annotations

import functools
import logging
import platform
import warnings
from abc import ABC, abstractmethod
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class BaseLinearMethod(ABC):
    """How a linear layer stores its weight and computes `x W^T + b`.

    One instance may serve many layers: per-layer state lives on the layer, and what the method
    keeps itself (e.g. the kernel chosen per batch size) is shared by all of them."""

    name: str = "base"
    # where a method that caches its prepared layers does so (engine/quant/prepared.py PreparedCache),
    # set before `process_layers` by engine/quant's process_weights_after_loading; None: no cache
    prepared = None
    # True: a row-parallel layer keeps its whole weight on every rank and gathers its input
    # (engine/parallel/layers.py), instead of summing the ranks' partial products (the batch-invariant method)
    replicates_row_parallel: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       weight_loader: Callable) -> None:
        """Registers the parameters the checkpoint's tensors load into.

        Args:
            layer: the linear layer; gets `layer.weight`, shape (output_size, input_size), in
                torch's current default dtype and device, with `weight.weight_loader` set.
            input_size, output_size: this rank's shard (already divided by the TP size).
            weight_loader: the layer's `weight_loader(param, full[, shard_id])`.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns one layer's loaded weight into what `apply` uses (pack, quantize). Runs once,
        after every shard is in, so quantization sees exactly this rank's slice."""

    def process_layers(self, layers: list[nn.Module]) -> None:
        """Processes every layer this method serves (a method that measures kernels on the model's
        shapes does so here, first)."""
        for layer in layers:
            self.process_weights_after_loading(layer)

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Args:
            x: (num_tokens, input_size) in the model dtype.
            bias: (output_size,) or None (RowParallelLinear passes it on rank 0 only).
        Returns:
            (num_tokens, output_size) in x's dtype.
        """

    def describe(self, layers: list[nn.Module]) -> str:
        """One line for the load log: what runs for these layers."""
        return self.name


def mkldnn_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN weight packing needs the op in this torch build with oneDNN enabled; bf16 also a CPU
    with native bf16 support (avx512bw/vl/dq or avx_ne_convert), which an AVX2-only CPU lacks."""
    from engine.core.config import cpu_has_native_bf16
    have = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()
    return have and (dtype == torch.float32 or cpu_has_native_bf16())


def _wants_packing(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)


class UnquantizedLinearMethod(BaseLinearMethod):
    """The checkpoint's weights in the model dtype: on a CPU each weight is prepacked once into
    oneDNN's blocked layout (bf16 where the CPU has native bf16; fp32 always), else `F.linear`.

    F.linear reorders a bf16 weight into that layout on every call; packing once makes bf16
    decode matmuls about 1.5-2x faster. In fp32, F.linear streams cold weights at about half the
    rate of the packed kernel (SmolLM2's 30 layers and LM head at 8 tokens: 62 vs 26 ms here);
    the packed result differs from F.linear's by accumulation order only (relative 1e-7).
    `layer.weight` stays the source of truth."""

    name = "unquantized"

    def create_weights(self, layer, input_size, output_size, weight_loader) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = weight_loader

    def process_layers(self, layers) -> None:
        super().process_layers(layers)
        if layers and _wants_packing(layers[0].weight) and layers[0].packed is None:
            logger.warning("linear layers: F.linear (oneDNN %s weight packing unavailable: torch build or CPU "
                           "lacks it)", _short(layers[0].weight.dtype))

    def process_weights_after_loading(self, layer) -> None:
        layer.packed = None
        if _wants_packing(layer.weight) and mkldnn_packing_available(layer.weight.dtype):
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data)

    def apply(self, layer, x, bias) -> torch.Tensor:
        packed = getattr(layer, "packed", None)
        if packed is not None:
            x2 = x.reshape(-1, x.shape[-1])
            m = x2.shape[0]
            rows = padded_rows(m)
            if rows != m:  # zero rows in, their outputs dropped
                x2 = F.pad(x2, (0, 0, 0, rows - m))
            out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")[:m]
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, layer.weight, bias)

    def describe(self, layers) -> str:
        if not layers:
            return "F.linear"
        weight = layers[0].weight
        if not _wants_packing(weight):
            return f"F.linear ({weight.device.type}, {weight.dtype})"
        if getattr(layers[0], "packed", None) is None:
            return f"F.linear (oneDNN {_short(weight.dtype)} weight packing unavailable: torch build or CPU lacks it)"
        return f"oneDNN prepacked {_short(weight.dtype)} weights"


def padded_rows(m: int) -> int:
    """The row count a packed oneDNN linear runs for `m` rows: m up to 16, then rounded up to a
    multiple of 16 (to 256), 64 (to 1024), 256 beyond.

    oneDNN builds (JIT-compiles) and keeps a kernel for every input shape it meets; fed the
    engine's batches as they come (any count of tokens up to max_num_batched_tokens), a process's
    memory grew ~25 MB per 50 requests of a soak and kept growing. Rounding bounds the shapes at
    ~50 per weight, for at most 15 zero rows of work at prefill sizes."""
    if m <= 16:
        return m
    step = 16 if m <= 256 else 64 if m <= 1024 else 256
    return -(-m // step) * step


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


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
    (int8: qweight, scale; int4, engine/quant/integer.py: qweight, scales, mins), then the dtype."""

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

    def state_tensors(self, state: Any) -> list[torch.Tensor] | None:
        """The tensors `restore` rebuilds `prepare`'s state from (the prepared-layer cache on disk:
        engine/quant/prepared.py); None: the state is not plain tensors and is not cached. This
        default takes a tuple of tensors."""
        if isinstance(state, tuple) and all(isinstance(t, torch.Tensor) for t in state):
            return list(state)
        return None

    def restore(self, tensors: list[torch.Tensor]) -> Any:
        """`prepare`'s state from `state_tensors`' tensors, read back: what `run` takes."""
        return tuple(tensors)


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

    def state_tensors(self, state):
        return [state.weight]  # oneDNN's packed copy is opaque: packed again on restore (cheap)

    def restore(self, tensors):
        return self.unquantized_state(tensors[0])

    @staticmethod
    def unquantized_state(weight: torch.Tensor) -> SimpleNamespace:
        """What the unquantized method keeps for a float (out, in) weight (packed on a CPU)."""
        layer = SimpleNamespace(weight=weight)
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        return layer

    def run(self, state, x):
        return UnquantizedLinearMethod().apply(state, x, None)


KERNELS = {k.name: k for k in (FbgemmKernel, Int8PackKernel, ReferenceKernel, ReferenceW8A8Kernel)}
