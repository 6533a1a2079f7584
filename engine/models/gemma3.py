"""Gemma 3 (text): Gemma 2's layer (four norms of x * (1 + w), a GeGLU MLP, embeddings scaled by
sqrt(hidden_size), the softmax scale query_pre_attn_scalar ** -0.5) with a norm of the same kind
over each head's q and k before the rotation, no attention soft-capping, sliding and global layers
per `layer_types` (five to one in the published models), and a rotary embedding per layer type: the
global layers rotate at rope_theta with their scaling (linear x8 on 4B and up), the sliding ones at
their local base (10000) unscaled.

transformers' Gemma3ForCausalLM (`modeling_gemma3.py`, `Gemma3TextConfig`) is the reference. The
multimodal Gemma3ForConditionalGeneration (4B and up as published) is another architecture.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.core.config import ModelConfig
from engine.core.expert_placement import ExpertPlacement
from engine.layers.common import RotaryEmbedding
from engine.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm
from engine.models.hf_config import (LAYER_TYPES, alternating_layer_types, checked_layer_types, checked_rope_scaling,
                                     llama_like_fields, refuse)
from engine.models.llama import LlamaAttention
from engine.parallel.layers import TPGroup
from engine.quant.base import BaseLinearMethod

HF_ARCHITECTURE = "Gemma3ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults for keys a config.json may leave out
DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True,
                query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6)
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused_rotary: bool = False, window: int | None = None):
        super().__init__(cfg, tp, linear_method, fused_rotary, window)
        # over each head's head_dim values, Gemma's x * (1 + w) where Qwen3's is x * w
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention = Gemma3Attention

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), window: int | None = None, layer: int = 0, held=None):
        super().__init__(cfg, tp, linear_method, fused, window, layer, held)
        self.layer_type = cfg.layer_types[layer]  # which rotary embedding it takes

    def forward(self, rope, hidden, residual, kv_cache, meta, backend):
        """rope: LayerTypeRotary's, of every layer type; this layer attends with its own type's."""
        if self.self_attn.fused_rotary:  # (positions, {layer type: cos_sin table})
            rope = (rope[0], rope[1][self.layer_type])
        else:  # {layer type: (cos, signed sin)}
            rope = rope[self.layer_type]
        return super().forward(rope, hidden, residual, kv_cache, meta, backend)


class LayerTypeRotary(nn.Module):
    """A rotary embedding per layer type, each with the base and scaling `ModelConfig.rope` gives
    it; computed once a step for all layers, like the one rotary embedding of other families."""

    def __init__(self, cfg: ModelConfig, full: RotaryEmbedding):
        super().__init__()
        theta, scaling = cfg.rope("sliding_attention")
        self.by_type = nn.ModuleDict({"full_attention": full, "sliding_attention": RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, theta, scaling)})

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.by_type.items()}

    def cos_sin_table(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {kind: rotary.cos_sin_table(dtype) for kind, rotary in self.by_type.items()}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), expert_placement: ExpertPlacement | None = None):
        assert len(cfg.layer_types) == cfg.num_layers, "Gemma 3 names every layer's type (its rotary embedding)"
        super().__init__(cfg, tp, linear_method, fused, expert_placement)
        self.rotary = LayerTypeRotary(cfg, full=self.rotary)  # the global layers': rope_theta, rope_scaling


MODEL = Gemma3ForCausalLM


def rope_by_layer_type(cfg: dict, name: str) -> dict[str, tuple[float, dict | None]]:
    """(theta, scaling) per layer type, as Gemma3TextConfig reads them: transformers 5's
    `rope_parameters` per layer type, or the older keys (`rope_theta` and `rope_scaling` for the
    global layers, `rope_local_base_freq` for the sliding ones); a `rope_scaling` applies to the
    global layers either way. Refuses rope_parameters not keyed by layer type."""
    params = cfg.get("rope_parameters") or {}
    if flat := sorted(set(params) - set(LAYER_TYPES)):
        raise refuse(name, f"rope_parameters keys {flat} (Gemma 3's are per layer type)")
    older = {"full_attention": cfg.get("rope_theta"), "sliding_attention": cfg.get("rope_local_base_freq")}
    ropes = {}
    for kind in LAYER_TYPES:
        p = {**(params.get(kind) or {}), **((cfg.get("rope_scaling") or {}) if kind == "full_attention" else {})}
        if (partial := p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse(name, f"partial_rotary_factor {partial!r} ({kind})")
        theta = p.get("rope_theta") or older[kind] or DEFAULT_THETA[kind]
        ropes[kind] = float(theta), checked_rope_scaling(p, name)
    return ropes


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """attn_logit_softcapping is ignored, as transformers' Gemma 3 attention ignores it."""
    cfg = {**DEFAULTS, **cfg}
    fields = llama_like_fields(cfg, name, ACTIVATION, "hidden_activation", softcapping=True)
    num_layers = fields["num_layers"]
    types = cfg.get("layer_types") or alternating_layer_types(num_layers, cfg["sliding_window_pattern"])
    ropes = rope_by_layer_type(cfg, name)
    (full_theta, full_scaling), (local_theta, local_scaling) = ropes["full_attention"], ropes["sliding_attention"]
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(**{**fields, "rope_theta": full_theta, "rope_scaling": full_scaling},
                       architecture="gemma3", qk_norm=True, qkv_bias=bias, o_bias=bias,
                       sliding_window=cfg["sliding_window"], layer_types=checked_layer_types(types, num_layers, name),
                       sliding_rope_theta=local_theta, sliding_rope_scaling=local_scaling,
                       final_logit_softcapping=cfg.get("final_logit_softcapping"),
                       query_pre_attn_scalar=cfg["query_pre_attn_scalar"])
