"""A rank's model, built once when its runner starts (engine/runner/model_runner.py): the linear
method the quantization knob picks, the model class on the device, its weights (every parameter
must come), the LM head from a GGUF's Q8_0 blocks where that is faster, then the linear layers and
experts prepared for the machine. Nothing here runs in a step."""
from __future__ import annotations

import logging
import time

import torch

from engine.core.config import EngineConfig, ModelConfig
from engine.core.expert_placement import placement_for
from engine.layers.mla import select_prefill_forms
from engine.layers.moe import describe_experts, quantize_model_experts, select_expert_methods
from engine.loading.loader import load_weights
from engine.models import model_class
from engine.parallel.layers import TPGroup
from engine.quant import (create_linear_method, expert_scheme, method_reads_q4_codes, process_weights_after_loading,
                          resolve_quantization)
from engine.quant.base import BaseLinearMethod
from engine.quant.batch_invariant import BatchInvariantLinearMethod
from engine.quant.prepared import PreparedCache
from engine.quant.q8_head import q8_head_method

logger = logging.getLogger(__name__)


def load_model(config: EngineConfig, model_config: ModelConfig, tp: TPGroup, device: torch.device,
               dtype: torch.dtype, fused, path, weights) -> tuple[torch.nn.Module, str]:
    """The model with this rank's weights (from `path`, or the given (name, tensor) pairs), in eval
    mode, and a description of its linear layers."""
    if config.expert_parallel and model_config.moe is None:
        raise ValueError(f"--enable-expert-parallel: {model_config.name} has no experts to partition")
    start = time.perf_counter()
    method = linear_method(config, model_config, tp.size, path if weights is None else None)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(model_config)(model_config, tp, linear_method=method, fused=fused,
                                              expert_placement=placement_for(config, model_config, tp))
    finally:
        torch.set_default_dtype(torch.float32)
    weights_from_file = weights is None
    if weights is None:
        weights = load_weights(path, dtype, q4_codes=method_reads_q4_codes(method))
    # each parameter's copy_ casts to its own dtype (int4 codes stay uint8, their scales fp32)
    loaded = model.load_weights((n, w.to(device)) for n, w in weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    logger.info("loaded weights in %.2f s", time.perf_counter() - start)
    start = time.perf_counter()
    if config.batch_invariant:
        model.lm_head.linear_method = method
    elif weights_from_file and (head := q8_head_method(path, method, dtype, device, tp.size)) is not None:
        model.lm_head.linear_method = head
    # after every shard is in, so a quantizing method sees exactly this rank's slice
    prepared = PreparedCache.for_model(path if weights_from_file else None, tp.rank, tp.size, dtype, device)
    described = process_weights_after_loading(model, prepared)
    logger.info("linear layers: %s; prepared in %.2f s", described, time.perf_counter() - start)
    quantize_model_experts(model, expert_scheme(method), dtype)
    select_expert_methods(model, config.expert_method)
    if (experts := describe_experts(model)) is not None:
        logger.info("experts: %s", experts)
    if (latent := select_prefill_forms(model, tp)) is not None:
        logger.info("%s", latent)
    return model.eval(), described


def linear_method(config: EngineConfig, model_config: ModelConfig, tp_size: int, path) -> BaseLinearMethod:
    """The quantization knob's linear method; with --batch-invariant, unquantized weights in its
    tiled matmul (a quantized checkpoint dequantized at load), and an explicit int8/w8a8/int4
    refused."""
    if not config.batch_invariant:
        name = resolve_quantization(config.quantization, path, model_config, tp_size, config.expert_parallel)
        return create_linear_method(name, path)
    if model_config.moe is not None:
        raise ValueError(f"--batch-invariant does not run mixture-of-experts models yet ({model_config.name}: "
                         "its expert GEMMs take as many rows as the batch routes to each expert)")
    if config.quantization not in ("auto", "none"):
        raise ValueError(f"--batch-invariant runs unquantized weights; --quantization {config.quantization} "
                         "cannot run with it (use auto or none)")
    logger.info("batch-invariant mode: weights unquantized (dequantized at load), fixed-tile matmuls, "
                "fixed-split attention")
    return BatchInvariantLinearMethod()
