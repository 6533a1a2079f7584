"""gpt-oss (openai/gpt-oss-20b and -120b): the Llama decoder with biases on q, k, v and o, a learned
attention sink per head (a logit in each softmax's denominator: engine/attention/base.py), sliding
(128 keys) and full layers alternating per `layer_types`, YaRN rope, and in every layer a mixture
of experts (engine/layers/moe.py) whose router has a bias (top-k of its logits, then a softmax over those:
the renormalized softmax top-k) and whose experts carry biases and apply a clamped SwiGLU to
interleaved gate/up rows (engine/layers/expert_compute.py `swiglu_oai`).

Its checkpoints store each layer's experts stacked: `mlp.experts.gate_up_proj` (E, hidden, 2 *
inter) with gate and up columns interleaved and `down_proj` (E, inter, hidden), each with a bias;
OpenAI's published files ship them as MXFP4 (`*_blocks` and `*_scales`, (E, out, in) once decoded),
dequantized here on load to the model's dtype and logged (engine/quant/mxfp4.py).

transformers' `modeling_gpt_oss.py` is the reference (tests/engine/models/test_families.py).
"""
from __future__ import annotations

import logging
import re
from typing import Iterable, Iterator

import torch

from engine.core.config import ModelConfig, MoEConfig
from engine.models.hf_config import (UnsupportedConfig, alternating_layer_types, checked_layer_types,
                                     llama_like_fields, refuse)
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

HF_ARCHITECTURE = "GptOssForCausalLM"
CHECKPOINT_QUANT = ("mxfp4",)  # a config.json quantization_config this family loads (its experts' format)
# transformers' GptOssConfig defaults, for a config.json that leaves them out
ROPE_THETA = 150000.0
ROPE_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # what vLLM-CPU's fused "swigluoai" also hard-codes

# layers.N.mlp.experts.<tensor>: the FusedExperts parameter it fills, and whether the checkpoint's
# float tensor is stored transposed to it ((E, in, out) where the parameter is (E, out, in))
EXPERT_TENSORS = {"gate_up_proj": ("w13_weight", True), "gate_up_proj_bias": ("w13_bias", False),
                  "down_proj": ("w2_weight", True), "down_proj_bias": ("w2_bias", False)}
STACKED = re.compile(r"^(?P<experts>layers\.\d+\.mlp\.experts)\.(?P<tensor>\w+?)(?P<mxfp4>:mxfp4)?$")
MXFP4_PART = re.compile(r"^(?P<base>.*\.experts\.\w+)_(?P<part>blocks|scales)$")


class GptOssForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, with the stacked experts (float or MXFP4) put in their layer's FusedExperts."""
        dtype = self.embed_tokens.weight.dtype
        stacked: set[str] = set()

        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in with_mxfp4_decoded(weights, dtype):
                m = STACKED.match(name.removeprefix("model."))
                if m is None or m["tensor"] not in EXPERT_TENSORS:
                    yield name, tensor
                    continue
                param, transposed = EXPERT_TENSORS[m["tensor"]]
                experts = self.get_submodule(m["experts"])
                if transposed and not m["mxfp4"]:
                    tensor = tensor.transpose(1, 2)
                experts.load_stacked(getattr(experts, param), tensor)
                stacked.add(f"{m['experts']}.{param}")

        return super().load_weights(the_rest()) | stacked

    def param_target(self, name: str) -> tuple[str, tuple]:
        return super().param_target(name.replace(".mlp.router.", ".mlp.gate."))


def with_mxfp4_decoded(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each MXFP4 pair (`X_blocks`, `X_scales`, in either order) replaced
    by `X:mxfp4`, X decoded to `dtype`; logs how many. Raises ValueError for a half without its pair."""
    from engine.quant.mxfp4 import dequantize_mxfp4
    pending: dict[tuple[str, str], torch.Tensor] = {}
    decoded = 0
    for name, tensor in weights:
        m = MXFP4_PART.match(name)
        if m is None:
            yield name, tensor
            continue
        other = pending.pop((m["base"], "scales" if m["part"] == "blocks" else "blocks"), None)
        if other is None:
            pending[(m["base"], m["part"])] = tensor
            continue
        blocks, scales = (tensor, other) if m["part"] == "blocks" else (other, tensor)
        decoded += 1
        yield f"{m['base']}:mxfp4", dequantize_mxfp4(blocks, scales, dtype)
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(b + '_' + p for b, p in pending)}")
    if decoded:
        logger.info("gpt-oss experts: %d MXFP4 tensors dequantized to %s on load (no kernel here runs them "
                    "packed)", decoded, str(dtype).removeprefix("torch."))


MODEL = GptOssForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    for key, value in SWIGLU.items():
        if cfg.get(key, value) != value:
            raise refuse(name, f"{key} {cfg[key]!r} (pdserve runs gpt-oss's {value})")
    if not (cfg.get("rope_scaling") or cfg.get("rope_parameters")):
        cfg = {**cfg, "rope_scaling": ROPE_SCALING, "rope_theta": cfg.get("rope_theta", ROPE_THETA)}
    fields = llama_like_fields(cfg, name)
    num_layers = fields["num_layers"]
    types = cfg.get("layer_types") or alternating_layer_types(num_layers)
    types = checked_layer_types(types, num_layers, name)
    window = cfg.get("sliding_window")
    bias = bool(cfg.get("attention_bias", True))
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
    if not num_experts or not top_k:
        raise UnsupportedConfig(f"{name}: config.json gives no expert count or experts per token")
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=cfg["intermediate_size"],
                    renormalize=True, router_bias=True, expert_bias=True, activation="swigluoai")
    return ModelConfig(**fields, architecture="gpt_oss", qkv_bias=bias, o_bias=bias, sliding_window=window,
                       layer_types=types if window else (), attention_sinks=True, moe=moe)
