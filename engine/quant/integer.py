"""The integer linear methods: int8 (per-channel) and int4 (group-wise, extending int8).

The int8 linear methods: per-channel int8 weights quantized after loading (base.py).

- `int8`: weight-only; activations stay in the model dtype. On SmolLM2 (fp32) perplexity x1.007.
- `w8a8`: activations quantized to int8 per tensor on every call too (fbgemm on x86), except the
  layers in `W8A8LinearMethod.unquantized_layers`, which stay unquantized: the MLP's down_proj
  input carries channels hundreds of times the mean (measured 900x on SmolLM2), and one scale per
  tensor then flattens the rest (w8a8 on down_proj alone: perplexity x1.67; on all but it: x1.05).

Which kernel runs for a batch of M tokens is measured at load on the model's own shapes
(engine/quant/selection.py).

The int4 linear method: group-wise 4-bit weights (engine/quant/q4.py), activations unquantized.

Weights come either straight from a GGUF's Q4_0 / Q4_1 / Q4_K blocks (`prequantized`: the file's
own numbers, exactly; what `--quantization auto` runs for such a file) or from a float checkpoint,
quantized at load onto llama.cpp's Q4_1 (`--quantization int4`; the error is logged). In a file
that mixes types (Q4_K_M: Q6_K for some layers), a layer whose tensors are of another type loads
their dequantized floats and runs as the unquantized method does (engine/quant/gguf_codes.py's plan).

Kernels, measured per batch-size range at load like int8's (engine/quant/selection.py):
- `int4pack`: torch's `_weight_int4pack_mm_for_cpu` (vectorized for bf16/fp16; scalar in fp32),
  which computes `(q - 8) * scale + zero` with scale and zero in the activations' dtype;
- `dequantized`: the weights dequantized once at load into the model dtype, then what the
  unquantized method runs (oneDNN-packed on a CPU, F.linear on GPUs): the same numbers, 4-8x the bytes, and
  usually the fastest for prefills;
- `reference`: plain torch, dequantized on every call; the tests' reference and the fallback.
A range whose winner is `dequantized` keeps that copy of the weights; the packed int4 weights are
kept only where `int4pack` wins."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.base import (BASELINE, KERNELS, LinearKernel, ReferenceKernel, ReferenceW8A8Kernel,
                               UnquantizedBaseline, UnquantizedLinearMethod, quantize_per_channel)
from engine.quant.q4 import GROUP_SIZE, dequantize_q4, quantize_q4_1, random_q4
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
        self._store = None  # while process_layers runs with a prepared-layer cache: its file

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
        self._store = None if self.prepared is None else self.prepared.open(
            self.name, self.cache_options(), {layer.layer_name: self.layer_shape(layer) for layer in layers},
            self.kernels, self.choices)
        for layer in layers:
            self.process_weights_after_loading(layer)
        if self._store is not None:
            self._store.finish()
            self._store = None

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

    def cache_options(self) -> dict:
        """What else of this method the prepared layers depend on (engine/quant/prepared.py's key)."""
        return {}

    def process_weights_after_loading(self, layer) -> None:
        """The layer's state for each kernel chosen (once per kernel, whatever ranges it runs): read
        from the prepared-layer cache where it holds them, else prepared from its weights (and kept)."""
        names = list(dict.fromkeys(c.kernel for c in self.choices))
        store = self._store
        states = store.states(layer.layer_name, names) if store is not None else None
        if states is None:
            weights, dtype = self.quantize(layer), self.layer_dtype(layer)
            states = {name: self.kernels[name].prepare(*weights, dtype) for name in names}
            if store is not None:
                store.keep(layer.layer_name, states)
        layer.quant_state = states
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


class Int4PackKernel(LinearKernel):
    name, label = "int4pack", "torch _weight_int4pack_mm_for_cpu"

    def unavailable(self, device):
        if device.type != "cpu":
            return f"a CPU kernel (device {device.type})"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return "not in this torch build"
        return None

    def unsupported(self, shape, dtype):
        if shape[0] % 16:
            return f"out_features {shape[0]} is not a multiple of 16 (torch's int4 packing needs it)"
        return None

    def prepare(self, qweight, scales, mins, dtype):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qweight.to(torch.int32), 1)
        zeros = mins + 8 * scales  # q * s + m == (q - 8) * s + (m + 8 s)
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous().to(dtype)  # (groups, out, 2)
        return packed, scales_and_zeros

    def run(self, state, x):
        packed, scales_and_zeros = state
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP_SIZE, scales_and_zeros)


class DequantizedKernel(UnquantizedBaseline):
    """The unquantized path on the weights dequantized once (a candidate here, not a baseline)."""

    name, label = "dequantized", "dequantized at load"

    def prepare(self, qweight, scales, mins, dtype):
        return self.unquantized_state(dequantize_q4(qweight, scales, mins, dtype))


class ReferenceInt4Kernel(LinearKernel):
    name, label = "reference", "plain torch (dequantize per call)"

    def prepare(self, qweight, scales, mins, dtype):
        return qweight, scales, mins

    def run(self, state, x):
        return F.linear(x, dequantize_q4(*state, x.dtype))


INT4_KERNELS = {k.name: k for k in (Int4PackKernel, DequantizedKernel, ReferenceInt4Kernel)}


class Int4LinearMethod(Int8LinearMethod):
    """Args (besides int8's: kernel, candidates, cache_path, time_fn):
        prequantized: the checkpoint holds Q4 codes (`qweight`, `scales`, `mins` per linear, as the
            GGUF loader yields them with `q4_codes=True`), or float weights for a layer of another
            type; False: float weights, quantized at load.
        expert_codes: a mixture's experts are codes too (else floats, left unquantized).
    """

    name = "int4"
    default_candidates = ("int4pack", "dequantized")
    fallback = ReferenceInt4Kernel
    kernel_registry = INT4_KERNELS
    baseline = None  # `dequantized` is what unquantized would run, and a candidate itself
    random_weights = staticmethod(random_q4)

    def __init__(self, prequantized: bool = False, expert_codes: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.prequantized, self.expert_codes = prequantized, expert_codes
        self.num_float = 0  # layers of a prequantized file loaded as floats (another GGUF type)
        self.errors: list[float] = []  # relative error of each float weight quantized at load

    def create_weights(self, layer, input_size, output_size, weight_loader) -> None:
        if input_size % GROUP_SIZE:
            raise ValueError(f"int4: {input_size} input features (per tensor-parallel rank) is not a multiple of "
                             f"the group size {GROUP_SIZE}")
        layer.params_dtype = torch.get_default_dtype()
        if not self.prequantized:
            return super().create_weights(layer, input_size, output_size, weight_loader)
        # either form, as the file holds it: both on the meta device until the first tensor loaded
        # makes its own form real (`_load_either`)
        layer.params_device = torch.empty(0).device
        groups = input_size // GROUP_SIZE
        for name, shape, dtype in (("weight", (output_size, input_size), layer.params_dtype),
                                   ("qweight", (output_size, input_size), torch.uint8),
                                   ("scales", (output_size, groups), torch.float32),
                                   ("mins", (output_size, groups), torch.float32)):
            param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
            param.weight_loader = functools.partial(_load_either, layer, name, weight_loader)
            setattr(layer, name, param)

    def layer_shape(self, layer):
        return tuple((layer.qweight if self.prequantized else layer.weight).shape)

    def layer_dtype(self, layer):
        return layer.params_dtype

    def layer_device(self, layer):
        return (layer.qweight if self.prequantized else layer.weight).device

    def quantize(self, layer):
        if self.prequantized:
            return layer.qweight.data, layer.scales.data, layer.mins.data
        weights = quantize_q4_1(layer.weight.data)
        w = layer.weight.data.float()
        self.errors.append(((dequantize_q4(*weights) - w).norm() / w.norm().clamp_min(1e-30)).item())
        return weights

    def cache_options(self) -> dict:
        return {"prequantized": self.prequantized}

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        if self.prequantized:
            layer.qweight = layer.scales = layer.mins = None

    def process_layers(self, layers) -> None:
        floats = [layer for layer in layers if self.prequantized and layer.weight is not None]
        for layer in floats:
            layer.int4_float = True
            UnquantizedLinearMethod.process_weights_after_loading(self, layer)
        self.num_float = len(floats)
        super().process_layers([layer for layer in layers if not getattr(layer, "int4_float", False)])
        if self.errors:
            logger.info("int4: float weights quantized to Q4_1 at load: relative error per layer mean %.4f, max %.4f",
                        sum(self.errors) / len(self.errors), max(self.errors))

    def apply(self, layer, x, bias) -> torch.Tensor:
        if getattr(layer, "int4_float", False):
            return UnquantizedLinearMethod.apply(self, layer, x, bias)
        return super().apply(layer, x, bias)

    def describe(self, layers) -> str:
        coded = [layer for layer in layers if not getattr(layer, "int4_float", False)]
        floats = [layer for layer in layers if getattr(layer, "int4_float", False)]
        parts = [super().describe(coded)] if coded else []
        if floats:
            parts.append(f"{len(floats)} layers of other GGUF types dequantized: "
                         f"{UnquantizedLinearMethod.describe(self, floats)}")
        return "; ".join(parts)

    @property
    def weights(self) -> str:
        source = "from the checkpoint's Q4 blocks" if self.prequantized else "Q4_1 quantized at load"
        return f"int4 group-wise ({GROUP_SIZE} per group, {source})"


def _load_either(layer: nn.Module, name: str, weight_loader, param: nn.Parameter, full: torch.Tensor, *shard) -> None:
    """Loads a checkpoint tensor into `layer.<name>`: the first one of a form makes that form's
    parameter real on the layer's device and drops the other form's placeholders."""
    current = getattr(layer, name)
    if current is None:
        raise ValueError(f"{getattr(layer, 'layer_name', type(layer).__name__)}: the checkpoint holds both float "
                         "weights and int4 codes for one layer")
    if current.is_meta:
        real = nn.Parameter(torch.empty(current.shape, dtype=current.dtype, device=layer.params_device),
                            requires_grad=False)
        real.weight_loader = current.weight_loader
        setattr(layer, name, real)
        for other in ("qweight", "scales", "mins") if name == "weight" else ("weight",):
            setattr(layer, other, None)
        current = real
    weight_loader(current, full, *shard)
