"""Reading a Hugging Face `config.json` into a `ModelConfig`: the keys every Llama-like family
shares, and the refusals of what no family here implements.

Each family's module (engine/models) calls `llama_like_fields` and sets its own switches. What a
config asks for that the family's transformers class would honour and pdserve does not run (an
activation, a rope type, soft-capping, partial rotary) raises `UnsupportedConfig`, one line
naming the key and its value; keys transformers' class itself ignores are ignored here too.
"""
from __future__ import annotations

import json
from pathlib import Path

ROPE_TYPES = ("linear", "llama3", "yarn")  # beyond the default; engine/layers/common.py RotaryEmbedding


class UnsupportedConfig(ValueError):
    """A checkpoint's config asks for what pdserve does not run."""


def refuse(name: str, what: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"{name}: {what} is not supported by pdserve")


def normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """HF `rope_scaling` with `rope_type` spelled out (old configs say `type`); None when default."""
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling


def checked_rope_scaling(scaling: dict | None, name: str) -> dict | None:
    """`normalize_rope_scaling`, refusing a rope type RotaryEmbedding does not have."""
    scaling = normalize_rope_scaling(scaling)
    if scaling is not None:
        if scaling.get("rope_type") not in ROPE_TYPES:
            raise refuse(name, f"rope type {scaling.get('rope_type')!r} (pdserve has {', '.join(ROPE_TYPES)})")
        if "mrope_section" in scaling:
            raise refuse(name, "multimodal rope (mrope_section)")
    return scaling


def token_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` as written (an int, a list, or null) -> a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def generation_eos(folder: Path) -> tuple[int, ...]:
    """`eos_token_id` of the folder's generation_config.json (what transformers' generate stops on)."""
    path = folder / "generation_config.json"
    return token_ids(json.loads(path.read_text()).get("eos_token_id")) if path.is_file() else ()


def tokenizer_eos_ids(folder: Path) -> tuple[int, ...]:
    """The id of the EOS token tokenizer_config.json names (Qwen's chat models end turns on
    <|im_end|>, which config.json may not list); () without a tokenizer."""
    config, vocab = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not config.is_file() or not vocab.is_file():
        return ()
    eos = json.loads(config.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not eos:
        return ()
    from tokenizers import Tokenizer  # loaded only for folders that carry one
    token_id = Tokenizer.from_file(str(vocab)).token_to_id(eos)
    return () if token_id is None else (token_id,)


def llama_like_fields(cfg: dict, name: str, activation: str = "silu", activation_key: str = "hidden_act",
                      softcapping: bool = False) -> dict:
    """`ModelConfig` keyword arguments from the keys Llama, Mistral, Qwen2, Qwen3 and Gemma 2 share.

    Args:
        activation, activation_key: the MLP activation the family runs, and the key naming it.
        softcapping: the family runs soft-capping (Gemma 2); else a config asking for it is refused.

    Raises:
        UnsupportedConfig: another activation, rope type, soft-capping or partial rotary.
    """
    if (act := cfg.get(activation_key) or activation) != activation:
        raise refuse(name, f"{activation_key} {act!r} (this family runs {activation!r})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if not softcapping and cfg.get(key) is not None:
            raise refuse(name, f"{key} {cfg[key]!r}")
    if cfg.get("use_bidirectional_attention"):
        raise refuse(name, "use_bidirectional_attention")
    rope_params = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta here
    if (partial := cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))) != 1.0:
        raise refuse(name, f"partial_rotary_factor {partial!r}")
    scaling = checked_rope_scaling(cfg.get("rope_scaling") or rope_params, name)
    num_heads = cfg["num_attention_heads"]
    eos, bos = token_ids(cfg.get("eos_token_id")), token_ids(cfg.get("bos_token_id"))
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=bos[0] if bos else None,
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
        name=name,
    )


LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen_windows(cfg: dict, num_layers: int, name: str) -> dict:
    """Qwen2/Qwen3's sliding window: on only with `use_sliding_window`, for the layers at and past
    `max_window_layers` unless the config lists `layer_types` (transformers' Qwen2Config)."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return {}
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(num_layers)]
    return dict(sliding_window=cfg["sliding_window"], layer_types=checked_layer_types(types, num_layers, name))


def alternating_layer_types(num_layers: int, period: int = 2) -> list[str]:
    """Every `period`-th layer full, the others sliding, from a sliding first layer: transformers'
    default `layer_types` of Gemma 2 and gpt-oss (period 2) and of Gemma 3 (its `sliding_window_pattern`, 6)."""
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]


def checked_layer_types(types: list[str], num_layers: int, name: str) -> tuple[str, ...]:
    """A config's `layer_types`, refused if it names a kind pdserve does not run or miscounts."""
    if unknown := sorted(set(types) - set(LAYER_TYPES)):
        raise refuse(name, f"layer_types {unknown}")
    if len(types) != num_layers:
        raise UnsupportedConfig(f"{name}: layer_types lists {len(types)} layers, the model has {num_layers}")
    return tuple(types)


def moe_config(cfg: dict, name: str, intermediate_key: str, renormalize: bool, shared_key: str | None = None):
    """The `MoEConfig` of a Mixtral- or Qwen-MoE-style config (softmax top-k routing).

    Args:
        intermediate_key: the key of each expert's width. The expert count is `num_experts` (Qwen's
            published configs) or `num_local_experts` (Mixtral's; transformers 5 writes Qwen's so too).
        renormalize: the family's own renormalizing (Mixtral: always); Qwen's `norm_topk_prob` overrides it.
        shared_key: the key of the shared expert's width (Qwen2-MoE), None where the family has none.
    """
    from engine.core.config import MoEConfig
    if cfg.get("use_sliding_window"):
        raise refuse(name, "use_sliding_window in a mixture-of-experts model")
    num_layers = cfg["num_hidden_layers"]
    dense = tuple(cfg.get("mlp_only_layers") or ())
    if bad := [i for i in dense if not 0 <= i < num_layers]:
        raise UnsupportedConfig(f"{name}: mlp_only_layers {bad} name layers the model does not have ({num_layers})")
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts:
        raise UnsupportedConfig(f"{name}: config.json gives no expert count (num_experts or num_local_experts)")
    return MoEConfig(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg[intermediate_key],
                     renormalize=bool(cfg.get("norm_topk_prob", renormalize)),
                     shared_expert_intermediate_size=cfg.get(shared_key, 0) if shared_key else 0,
                     sparse_step=cfg.get("decoder_sparse_step", 1) or 1, dense_layers=dense)
