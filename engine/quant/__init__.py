"""Linear methods: how linear layers store and multiply their weights (engine/quant/base.py).

    method = create_linear_method(resolve_quantization(config.quantization, path))
    model = LlamaForCausalLM(cfg, tp, linear_method=method)    # layers call method.create_weights
    model.load_weights(...)
    process_weights_after_loading(model)                       # method.process_layers(its layers)

Built: `unquantized` (the checkpoint's weights in the model dtype), `int8` (per-channel int8
weights quantized at load, activations unquantized) and `w8a8` (int8 activations too); for the
last two the kernel is measured per batch size. Not built yet: int4 group-wise (GGUF's Q4 types
kept as they are, instead of dequantized at load), fp8 (GPUs), calibrated activation scales.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from engine.quant.base import BaseLinearMethod, UnquantizedLinearMethod, mkldnn_packing_available
from engine.quant.int8 import Int8LinearMethod, W8A8LinearMethod

logger = logging.getLogger(__name__)

LINEAR_METHODS = {"unquantized": UnquantizedLinearMethod, "int8": Int8LinearMethod, "w8a8": W8A8LinearMethod}

__all__ = ["BaseLinearMethod", "LINEAR_METHODS", "UnquantizedLinearMethod", "Int8LinearMethod", "W8A8LinearMethod",
           "create_linear_method", "linear_layers", "mkldnn_packing_available", "process_weights_after_loading",
           "resolve_quantization"]


def create_linear_method(name: str, **kwargs) -> BaseLinearMethod:
    """A linear method by registry name (`unquantized`, `int8`); kwargs go to its constructor."""
    if name not in LINEAR_METHODS:
        raise ValueError(f"unknown linear method {name!r}; choose one of {', '.join(LINEAR_METHODS)}")
    return LINEAR_METHODS[name](**kwargs)


def resolve_quantization(quantization: str, path: str | os.PathLike | None = None) -> str:
    """The linear method a `quantization` knob asks for.

    `auto` keeps the checkpoint's format. Today every checkpoint runs unquantized: GGUF weights
    are dequantized at load and safetensors hold bf16/fp32, so auto is `unquantized`. `none` forces
    it; `int8` and `w8a8` are opt-in, lossy conversions at load."""
    if quantization == "none":
        return "unquantized"
    if quantization != "auto":
        if quantization not in LINEAR_METHODS:
            raise ValueError(f"unknown quantization {quantization!r}; choose auto, none or one of "
                             f"{', '.join(m for m in LINEAR_METHODS if m != 'unquantized')}")
        return quantization
    kind = "GGUF, dequantized at load" if path is not None and Path(path).suffix == ".gguf" else "float weights"
    logger.info("quantization auto -> unquantized: the checkpoint's format (%s; int4 kernels for GGUF's Q4 "
                "weights are not built yet; int8 and w8a8 are opt-in)", kind)
    return "unquantized"


def linear_layers(model: nn.Module) -> dict[BaseLinearMethod, list[nn.Module]]:
    """Every module that delegates to a linear method, grouped by method (in model order). Each gets
    `layer_name`, its name in the model (`layers.3.mlp.down_proj`), for methods that treat some
    layers apart (vLLM passes the same as `prefix`)."""
    groups: dict[BaseLinearMethod, list[nn.Module]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, BaseLinearMethod):
            module.layer_name = name
            groups.setdefault(method, []).append(module)
    return groups


def process_weights_after_loading(model: nn.Module) -> str:
    """Runs each method's `process_layers` on its layers once every shard is loaded; returns what
    runs where, for the load log (layers that run alike counted together)."""
    counts: dict[str, int] = {}
    for method, layers in linear_layers(model).items():
        method.process_layers(layers)
        text = method.describe(layers)
        counts[text] = counts.get(text, 0) + len(layers)
    return "; ".join(f"{text} ({n} layers)" for text, n in counts.items())
