"""DeepSeek-V3 and R1 (and Kimi K2, the same architecture): DeepSeek-V2's model
(engine/models/deepseek_v2.py) with V3's router: sigmoid scores, experts chosen on score plus the
router's `e_score_correction_bias` within the `topk_group` best of `n_group` groups ("noaux_tc"),
the chosen scores renormalized with `norm_topk_prob`, times `routed_scaling_factor`; the rotary
dims interleaved unless `rope_interleave` is false."""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models.deepseek_v2 import CHECKPOINT_QUANT, DeepseekForCausalLM, deepseek_fields, deepseek_moe
from engine.models.hf_config import refuse

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL = DeepseekForCausalLM
__all__ = ["CHECKPOINT_QUANT", "HF_ARCHITECTURE", "MODEL", "config_from_hf"]


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise refuse(name, f"topk_method {cfg['topk_method']!r} in DeepSeek-V3 (its router is noaux_tc)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise refuse(name, f"scoring_func {cfg['scoring_func']!r} in DeepSeek-V3")
    return ModelConfig(**deepseek_fields(cfg, name, rope_interleave=cfg.get("rope_interleave", True)),
                       architecture="deepseek_v3",
                       moe=deepseek_moe(cfg, name, "noaux_tc", renormalize=bool(cfg.get("norm_topk_prob", True))))
