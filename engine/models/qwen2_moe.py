"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose sparse layers' MLP is a mixture
of experts with a shared expert beside them, gated by a sigmoid of its own linear (engine/layers/moe.py);
softmax top-k, renormalized only with `norm_topk_prob`; `decoder_sparse_step` and `mlp_only_layers`
say which layers are sparse (the others keep a dense MLP of `intermediate_size`)."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields, moe_config
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    return ModelConfig(**llama_like_fields(cfg, name), architecture="qwen2_moe", qkv_bias=cfg.get("qkv_bias", True),
                       moe=moe_config(cfg, name, "moe_intermediate_size", renormalize=False,
                                      shared_key="shared_expert_intermediate_size"))
