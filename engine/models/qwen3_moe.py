"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (per-head q/k norms) whose sparse
layers' MLP is a mixture of experts without a shared one (engine/layers/moe.py); softmax top-k,
renormalized with `norm_topk_prob`; `decoder_sparse_step` and `mlp_only_layers` as Qwen2-MoE's."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields, moe_config
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(**llama_like_fields(cfg, name), architecture="qwen3_moe", qk_norm=True, qkv_bias=bias,
                       o_bias=bias, moe=moe_config(cfg, name, "moe_intermediate_size", renormalize=False))
