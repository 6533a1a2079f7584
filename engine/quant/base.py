"""The linear-method interface and the unquantized method.

A linear layer (engine/parallel/layers.py) owns its shapes, its sharding and its collectives; its
*linear method* owns how the weight is stored and multiplied (vLLM's `LinearMethodBase`):

    method.create_weights(layer, ...)          # at construction: the parameters checkpoints load into
    model.load_weights(...)                    # each rank copies its own shard in (weight_loader)
    method.process_layers(layers)              # once, after loading: pack, quantize, pick kernels
    y = method.apply(layer, x, bias)           # every forward
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class BaseLinearMethod(ABC):
    """How a linear layer stores its weight and computes `x W^T + b`.

    One instance may serve many layers: per-layer state lives on the layer, and what the method
    keeps itself (e.g. the kernel chosen per batch size) is shared by all of them."""

    name: str = "base"
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
