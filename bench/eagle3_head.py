"""A random EAGLE-3 head for a target, in the published checkpoints' layout (config.json +
safetensors): what the tests build heads from, and what bench.speculative's `--head random` times
(the cost of a head; its drafts are next to never kept).

    save_eagle3_head(folder, target_hf_config, seed=0, draft_vocab=4096)
    target_hf_config("smollm2")     # a model's shape as a HF config dict
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def target_hf_config(model: str) -> dict:
    """The keys a head is shaped by, from the model's config (a GGUF's or a HF folder's)."""
    from engine.loading.loader import load_model_config
    c = load_model_config(model)
    return {"hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings}


def save_eagle3_head(path: Path, target: dict, seed: int, draft_vocab: int | None = None,
                     aux_ids: list[int] | None = None, tensors: dict | None = None) -> Path:
    """A random head for a target of HF config `target`; `tensors` replace the random ones by name.
    Its draft vocabulary is a random subset of the target's (d2t), `draft_vocab` tokens."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    hd, inter, vocab = h // heads, target["intermediate_size"], target["vocab_size"]
    dv = draft_vocab or vocab

    def w(*shape):
        return torch.randn(*shape, generator=g) * 2.5 / shape[-1] ** 0.5

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    ids = torch.randperm(vocab, generator=g)[:dv].sort().values
    t = {"fc.weight": w(h, 3 * h), "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h), "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": w(h, heads * hd), "midlayer.mlp.gate_proj.weight": w(inter, h),
         "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter),
         "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
         "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(), "lm_head.weight": w(dv, h),
         "d2t": ids - torch.arange(dv), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
    t.update(tensors or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, path / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": dv,
              "rms_norm_eps": target["rms_norm_eps"], "rope_theta": target.get("rope_theta", 10000.0),
              "max_position_embeddings": target["max_position_embeddings"], "tie_word_embeddings": False}
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    (path / "config.json").write_text(json.dumps(config))
    return path
