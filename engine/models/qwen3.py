"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head's q and k before the rotary
embedding, biases only where `attention_bias` says, and Qwen2's window switches."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields, qwen_windows
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "Qwen3ForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    fields, bias = llama_like_fields(cfg, name), bool(cfg.get("attention_bias", False))
    return ModelConfig(**fields, architecture="qwen3", qk_norm=True, qkv_bias=bias, o_bias=bias,
                       **qwen_windows(cfg, fields["num_layers"], name))
