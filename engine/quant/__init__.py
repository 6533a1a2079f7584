"""Linear methods: how linear layers store and multiply their weights (engine/quant/base.py).

    name = resolve_quantization(config.quantization, path, model_config, tp_size)
    method = create_linear_method(name, path)
    model = LlamaForCausalLM(cfg, tp, linear_method=method)    # layers call method.create_weights
    model.load_weights(load_weights(path, dtype, q4_codes=method_reads_q4_codes(method)))
    process_weights_after_loading(model)                       # method.process_layers(its layers)

Built: `unquantized` (the checkpoint's weights in the model dtype), `int8` (per-channel int8
weights quantized at load, activations unquantized), `w8a8` (int8 activations too) and `int4`
(group-wise 4-bit: a GGUF's Q4_0 / Q4_1 / Q4_K blocks as they are, or a float checkpoint quantized
to Q4_1 at load); for the quantized ones the kernel is measured per batch size. Not built yet: fp8
(GPUs), calibrated activation scales, AWQ / GPTQ checkpoints.

Also here: a GGUF's 4-bit codes (gguf_codes.py) and the file's reader and tensor names
(gguf_file.py over gguf_header.py, which the float loader in engine/loading reads too); the
batch-invariant linear.

May import: engine.core.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from engine.core.config import ModelConfig
from engine.quant.base import BaseLinearMethod, UnquantizedLinearMethod, mkldnn_packing_available
from engine.quant.integer import Int4LinearMethod, Int8LinearMethod, W8A8LinearMethod
from engine.quant.q4 import GROUP_SIZE

logger = logging.getLogger(__name__)

LINEAR_METHODS = {"unquantized": UnquantizedLinearMethod, "int8": Int8LinearMethod, "w8a8": W8A8LinearMethod,
                  "int4": Int4LinearMethod}

__all__ = ["BaseLinearMethod", "LINEAR_METHODS", "UnquantizedLinearMethod", "Int4LinearMethod", "Int8LinearMethod",
           "W8A8LinearMethod", "create_linear_method", "expert_scheme", "experts_read_q4_codes", "gguf_code_plan_of",
           "int4_misfit", "linear_layers", "method_reads_q4_codes",
           "mkldnn_packing_available", "process_weights_after_loading", "resolve_quantization"]


def gguf_code_plan_of(path):
    """engine/quant/gguf_codes.py's plan for a GGUF at `path` (which linears are int4 codes), else None."""
    if path is None or Path(path).suffix != ".gguf" or not Path(path).is_file():
        return None
    from engine.quant.gguf_codes import gguf_code_plan
    return gguf_code_plan(path)


def create_linear_method(name: str, path: str | os.PathLike | None = None, **kwargs) -> BaseLinearMethod:
    """A linear method by registry name; kwargs go to its constructor. `int4` reads a GGUF's 4-bit
    blocks as they are where the file has them (engine/quant/gguf_codes.py), its other linears as
    floats; a checkpoint without any is quantized at load."""
    if name not in LINEAR_METHODS:
        raise ValueError(f"unknown linear method {name!r}; choose one of {', '.join(LINEAR_METHODS)}")
    if name == "int4":
        plan = gguf_code_plan_of(path)
        kwargs.setdefault("prequantized", bool(plan and plan.codes))
        kwargs.setdefault("expert_codes", bool(plan and plan.experts))
    return LINEAR_METHODS[name](**kwargs)


def method_reads_q4_codes(method: BaseLinearMethod) -> bool:
    """Whether the checkpoint's loader should yield int4 codes for this method (`load_weights(q4_codes=)`)."""
    return bool(getattr(method, "prequantized", False))


def experts_read_q4_codes(method: BaseLinearMethod | None) -> bool:
    """Whether a mixture's experts hold the file's int4 codes (engine/layers/fused_experts.py `q4_codes`)."""
    return method_reads_q4_codes(method) and bool(getattr(method, "expert_codes", False))


def expert_scheme(method: BaseLinearMethod) -> str:
    """The method name the experts are quantized as (engine/layers/moe.py `quantize_model_experts`): a
    GGUF's experts of other types than Q4 stay as dequantized, not quantized again to int4."""
    return "unquantized" if method_reads_q4_codes(method) and not experts_read_q4_codes(method) else method.name


def int4_misfit(config: ModelConfig, tp_size: int = 1, expert_parallel: bool = False) -> str | None:
    """Why int4's groups of 32 input features do not fit this model's linears at this TP size, or
    None. A mixture's experts are quantized too: each one's intermediate size is split by TP (whole
    under `expert_parallel`), as is the shared expert's."""
    value_width = config.head_dim if config.mla is None else config.mla.v_head_dim  # o_proj's input per head
    # name -> (input features of its linears, whether TP splits them)
    inputs = {"hidden_size": (config.hidden_size, False),
              "attention output": (config.num_heads * value_width, True),
              "intermediate_size": (config.intermediate_size, True)}
    if config.mla is not None and config.mla.q_lora_rank:  # q_b_proj's input, whole on every rank
        inputs["q_lora_rank"] = (config.mla.q_lora_rank, False)
    if (moe := config.moe) is not None:
        inputs["expert intermediate_size"] = (moe.intermediate_size, not expert_parallel)
        if moe.shared_expert_intermediate_size:
            inputs["shared expert intermediate_size"] = (moe.shared_expert_intermediate_size, True)
    for what, (n, split) in inputs.items():
        split = split and tp_size > 1
        if (n // tp_size if split else n) % GROUP_SIZE:
            per_rank = f" / tensor_parallel_size {tp_size}" if split else ""
            return (f"{what}{per_rank} = {n // tp_size if split else n} input features is not a multiple of "
                    f"int4's group size {GROUP_SIZE}")
    return None


def resolve_quantization(quantization: str, path: str | os.PathLike | None = None,
                         config: ModelConfig | None = None, tp_size: int = 1, expert_parallel: bool = False) -> str:
    """The linear method a `quantization` knob asks for.

    `auto` keeps the checkpoint's format: a GGUF with Q4_0 / Q4_1 / Q4_K decoder linears runs
    `int4` on exactly those weights (engine/quant/gguf_codes.py says which; its other types dequantized;
    unless int4's groups do not fit the TP shards: then all dequantized, logged); any other
    checkpoint runs `unquantized` (GGUF Q5_*, Q6_K, Q8_0, F16, ... dequantized at load;
    safetensors as stored). `none` forces unquantized; `int8`, `w8a8` and `int4` of a float
    checkpoint are opt-in, lossy conversions at load.
    Raises:
        ValueError: an unknown name, or `int4` whose groups do not fit (`int4_misfit`)."""
    if quantization == "none":
        return "unquantized"
    if quantization != "auto":
        if quantization not in LINEAR_METHODS:
            raise ValueError(f"unknown quantization {quantization!r}; choose auto, none or one of "
                             f"{', '.join(m for m in LINEAR_METHODS if m != 'unquantized')}")
        if quantization == "int4" and config is not None and (why := int4_misfit(config, tp_size, expert_parallel)):
            raise ValueError(f"quantization int4: {why}")
        return quantization
    if (plan := gguf_code_plan_of(path)) is not None and plan.codes:
        why = int4_misfit(config, tp_size, expert_parallel) if config is not None else None
        if why is None:
            logger.info("quantization auto -> int4: the GGUF's Q4_0/Q4_1/Q4_K weights as they are (%d tensors), "
                        "its other types dequantized", len(plan.codes))
            return "int4"
        logger.info("quantization auto -> unquantized: the GGUF's Q4 weights dequantized at load (%s)", why)
        return "unquantized"
    kind = "GGUF, dequantized at load" if path is not None and Path(path).suffix == ".gguf" else "float weights"
    logger.info("quantization auto -> unquantized: the checkpoint's format (%s; int8, w8a8 and int4 are opt-in)",
                kind)
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


def process_weights_after_loading(model: nn.Module, prepared=None) -> str:
    """Runs each method's `process_layers` on its layers once every shard is loaded; returns what
    runs where, for the load log (layers that run alike counted together). `prepared`: where the
    quantized methods cache their prepared layers (engine/quant/prepared.py PreparedCache), or None."""
    counts: dict[str, int] = {}
    for method, layers in linear_layers(model).items():
        method.prepared = prepared
        method.process_layers(layers)
        text = method.describe(layers)
        counts[text] = counts.get(text, 0) + len(layers)
    return "; ".join(f"{text} ({n} layers)" for text, n in counts.items())
