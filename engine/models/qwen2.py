"""Qwen2 and Qwen2.5: the Llama decoder with biases on the q, k and v projections (none on
o_proj), rope theta 1e6 as configured, YaRN for long context, and a sliding window only where
`use_sliding_window` turns it on (engine/models/hf_config.py `qwen_windows`)."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields, qwen_windows
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "Qwen2ForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    fields = llama_like_fields(cfg, name)
    return ModelConfig(**fields, architecture="qwen2", qkv_bias=True, **qwen_windows(cfg, fields["num_layers"], name))
