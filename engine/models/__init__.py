"""Model families: which class runs a checkpoint, and how its config is read.

    config = config_from_hf(json.loads(Path("config.json").read_text()), "name")
    model = model_class(config)(config, tp, linear_method=method, fused=fused)

A HF config is matched by its `architectures` (else its `model_type`), a GGUF by its
`general.architecture` (engine/loading/gguf_loader.py). Each family is a small module that reads its
config keys into `ModelConfig` switches and names the class that runs them; what a config asks for
that pdserve does not run is refused there, in one line naming it (engine/models/hf_config.py).

May import: engine.layers, engine.parallel, engine.attention, engine.quant, engine.core.
"""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.models import (deepseek_v2, deepseek_v3, gemma2, gemma3, gpt_oss, llama, mistral, mixtral, qwen2, qwen2_moe,
                           qwen3, qwen3_moe)
from engine.models.hf_config import UnsupportedConfig

FAMILIES = {"deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3, "gemma2": gemma2, "gemma3": gemma3,
            "gpt_oss": gpt_oss, "llama": llama, "mistral": mistral, "mixtral": mixtral,
            "qwen2": qwen2, "qwen2_moe": qwen2_moe, "qwen3": qwen3, "qwen3_moe": qwen3_moe}
HF_ARCHITECTURES = {module.HF_ARCHITECTURE: family for family, module in FAMILIES.items()}

__all__ = ["FAMILIES", "HF_ARCHITECTURES", "UnsupportedConfig", "config_from_hf", "family_of", "model_class"]


def family_of(cfg: dict, name: str) -> str:
    """The family of a HF config: its first `architectures` entry, else its `model_type`."""
    archs = cfg.get("architectures") or []
    if archs:
        if archs[0] not in HF_ARCHITECTURES:
            raise UnsupportedConfig(f"{name}: architecture {archs[0]!r} is not supported by pdserve "
                                    f"(it runs {', '.join(sorted(HF_ARCHITECTURES))})")
        return HF_ARCHITECTURES[archs[0]]
    if cfg.get("model_type") not in FAMILIES:
        raise UnsupportedConfig(f"{name}: config.json names no architecture pdserve runs (architectures missing, "
                                f"model_type {cfg.get('model_type')!r}; it runs {', '.join(sorted(FAMILIES))})")
    return cfg["model_type"]


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """A `ModelConfig` from a parsed HF `config.json`. Raises UnsupportedConfig."""
    return FAMILIES[family_of(cfg, name)].config_from_hf(cfg, name)


def model_class(config: ModelConfig) -> type:
    return FAMILIES[config.architecture].MODEL
