"""The int8 linear methods: per-channel int8 weights quantized after loading (kernels.py).

- `int8`: weight-only; activations stay in the model dtype. On SmolLM2 (fp32) perplexity x1.007.
- `w8a8`: activations quantized to int8 per tensor on every call too (fbgemm on x86), except the
  layers in `W8A8LinearMethod.unquantized_layers`, which stay unquantized: the MLP's down_proj
  input carries channels hundreds of times the mean (measured 900x on SmolLM2), and one scale per
  tensor then flattens the rest (w8a8 on down_proj alone: perplexity x1.67; on all but it: x1.05).

Which kernel runs for a batch of M tokens is measured at load on the model's own shapes
(engine/quant/selection.py).
"""
from __future__ import annotations

import logging

import torch

from engine.quant.base import UnquantizedLinearMethod
from engine.quant.kernels import (BASELINE, KERNELS, LinearKernel, ReferenceKernel, ReferenceW8A8Kernel,
                                  UnquantizedBaseline, quantize_per_channel)
from engine.quant.selection import KernelChoice, choose_kernels, random_int8

logger = logging.getLogger(__name__)


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads the checkpoint's float weights (as unquantized), then quantizes each rank's shard.

    Args:
        kernel: run this kernel for every batch size (tests); None = measure `candidates` at load.
        candidates: kernel names or `LinearKernel` objects to measure (default: the method's own).
        cache_path: the measurements' JSON cache (selection.py: default under the user's cache dir).
        time_fn: `time_fn(kernel_name, (out, in), num_tokens) -> ms`, to replace measuring (tests).
    """

    name = "int8"
    default_candidates: tuple[str, ...] = ("int8pack", "reference")
    fallback: type[LinearKernel] = ReferenceKernel  # runs where no candidate does (it is one, too)
    kernel_registry: dict[str, type[LinearKernel]] = KERNELS
    baseline: type[LinearKernel] | None = UnquantizedBaseline  # timed beside the candidates, for the log
    random_weights = staticmethod(random_int8)  # (shape, device) -> weights in this format, to time kernels on

    def __init__(self, kernel: str | None = None, candidates=None, cache_path=None, time_fn=None):
        names = self.default_candidates if candidates is None else candidates
        self.candidates = [self.kernel_registry[c]() if isinstance(c, str) else c for c in names]
        self.fixed = None if kernel is None else self.kernel_registry[kernel]()
        self.cache_path, self.time_fn = cache_path, time_fn
        self.choices: list[KernelChoice] = []
        self.kernels: dict[str, LinearKernel] = {}
        self.dtype: torch.dtype | None = None  # the activations' (the model's), known at load

    def process_layers(self, layers) -> None:
        if not layers:
            return
        dtype, device = self.layer_dtype(layers[0]), self.layer_device(layers[0])
        self.dtype = dtype
        shapes = sorted({self.layer_shape(layer) for layer in layers})
        if self.fixed is not None:
            for shape in shapes:
                why = self.fixed.unavailable(device) or self.fixed.unsupported(shape, dtype)
                if why is not None:
                    raise ValueError(f"{self.name} kernel {self.fixed.name} cannot run here: {why}")
            self.choices = [KernelChoice(None, self.fixed.name, {})]
            self.kernels = {self.fixed.name: self.fixed}
        else:
            usable = [k for k in self.candidates if not skip_kernel(self.name, k, device, shapes, dtype)]
            self.choices = choose_kernels(shapes, usable, dtype, device, self.fallback(), self.cache_path,
                                          self.time_fn, baseline=self.baseline() if self.baseline else None,
                                          random_weights=self.random_weights)
            self.kernels = {k.name: k for k in [*usable, self.fallback()]}
            _warn_if_slower(self.name, self.choices)
        for layer in layers:
            self.process_weights_after_loading(layer)

    def layer_shape(self, layer) -> tuple[int, int]:
        """(out, in) of this rank's shard."""
        return tuple(layer.weight.shape)

    def layer_dtype(self, layer) -> torch.dtype:
        """The activations' dtype (the model's)."""
        return layer.weight.dtype

    def layer_device(self, layer) -> torch.device:
        return layer.weight.device

    def quantize(self, layer) -> tuple[torch.Tensor, ...]:
        """This rank's loaded shard in the method's format (the tensors kernels `prepare` from)."""
        return quantize_per_channel(layer.weight.data)

    def process_weights_after_loading(self, layer) -> None:
        weights, dtype = self.quantize(layer), self.layer_dtype(layer)
        layer.quant_state = {c.kernel: self.kernels[c.kernel].prepare(*weights, dtype) for c in self.choices}
        layer.weight = None  # the float weight is no longer used; free it

    def kernel_for(self, num_tokens: int) -> str:
        return next(c.kernel for c in self.choices if c.max_m is None or num_tokens <= c.max_m)

    def apply(self, layer, x, bias) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (num_tokens, in)
        name = self.kernel_for(x2.shape[0])
        out = self.kernels[name].run(layer.quant_state[name], x2)  # (num_tokens, out)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def describe(self, layers) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        ranges = "; ".join(c.describe(self.kernels[c.kernel].label) for c in self.choices)
        return f"{self.name}: {self.weights} weights, {self.activations} activations ({dtype}): {ranges}"

    @property
    def weights(self) -> str:
        return "int8 per-channel"

    @property
    def activations(self) -> str:
        return "unquantized"


def _warn_if_slower(name: str, choices: list[KernelChoice]) -> None:
    for c in choices:
        mine, base = c.ms.get(c.kernel), c.ms.get(BASELINE)
        if mine is not None and base is not None and mine > base:
            logger.warning("%s: the fastest quantized kernel (%s) is slower than unquantized for %s (%.2f vs %.2f ms): "
                           "%s saves weight memory here, not time", name, c.kernel,
                           f"M<={c.max_m}" if c.max_m else "larger M", mine, base, name)


def skip_kernel(method: str, kernel: LinearKernel, device: torch.device, shapes, dtype: torch.dtype) -> bool:
    why = kernel.unavailable(device) or next(filter(None, (kernel.unsupported(s, dtype) for s in shapes)), None)
    if why is not None:
        logger.info("%s: kernel %s skipped: %s", method, kernel.label, why)
    return why is not None


class W8A8LinearMethod(Int8LinearMethod):
    """int8 weights and dynamically quantized int8 activations, except `unquantized_layers`."""

    name = "w8a8"
    default_candidates = ("fbgemm", "reference_w8a8")
    fallback = ReferenceW8A8Kernel
    unquantized_layers = ("down_proj",)  # layer-name suffixes kept unquantized (see the module docstring)

    def process_layers(self, layers) -> None:
        kept = [layer for layer in layers if getattr(layer, "layer_name", "").endswith(self.unquantized_layers)]
        for layer in kept:
            layer.w8a8_unquantized = True
            UnquantizedLinearMethod.process_weights_after_loading(self, layer)
        super().process_layers([layer for layer in layers if layer not in kept])
        self.num_unquantized = len(kept)

    def apply(self, layer, x, bias) -> torch.Tensor:
        if getattr(layer, "w8a8_unquantized", False):
            return UnquantizedLinearMethod.apply(self, layer, x, bias)
        return super().apply(layer, x, bias)

    @property
    def activations(self) -> str:
        return "int8 per-tensor dynamic"

    def describe(self, layers) -> str:
        kept = getattr(self, "num_unquantized", 0)
        return super().describe(layers) + (f"; {kept} {'/'.join(self.unquantized_layers)} layers unquantized"
                                           if kept else "")
