"""Mistral: the Llama decoder with a sliding window on every layer when `sliding_window` is set
(Mistral 7B v0.1: 4,096 keys; v0.2 on: null, full attention)."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "MistralForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    return ModelConfig(**llama_like_fields(cfg, name), architecture="mistral", sliding_window=cfg.get("sliding_window"))
