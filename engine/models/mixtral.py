"""Mixtral: the Mistral decoder whose every MLP is a mixture of experts (engine/layers/moe.py): softmax
top-2 of 8 experts, the two weights renormalized; its checkpoints name the block `block_sparse_moe`
and the experts' projections `w1` (gate), `w3` (up) and `w2` (down)."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.hf_config import llama_like_fields, moe_config
from engine.models.llama import LlamaForCausalLM

HF_ARCHITECTURE = "MixtralForCausalLM"


class MixtralForCausalLM(LlamaForCausalLM):
    def param_target(self, name: str) -> tuple[str, tuple]:
        return super().param_target(name.replace(".block_sparse_moe.", ".mlp."))


MODEL = MixtralForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    return ModelConfig(**llama_like_fields(cfg, name), architecture="mixtral", sliding_window=cfg.get("sliding_window"),
                       moe=moe_config(cfg, name, "intermediate_size", renormalize=True))
