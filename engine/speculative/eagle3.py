"""EAGLE-3's draft head (`--speculative-method eagle3 --speculative-model <head>`), in the layout of
the published EAGLE-3 checkpoints (config.json `LlamaForCausalLMEagle3`; vLLM and SGLang load the same):

    fc          (hidden, 3 * target_hidden)  three of the target's layers' inputs -> one hidden state
    midlayer    one Llama layer whose attention reads [input_layernorm(embed(token)) | hidden_norm(hidden)],
                2 * hidden wide; its residual is the hidden state
    norm, lm_head (draft_vocab, hidden), d2t (draft_vocab,): a draft token id d is target id d + d2t[d]
    embed_tokens  the target's, where the checkpoint has none

The target's rows are its residual stream entering layers `aux_layers` (by default 2, L // 2 and
L - 3 of its L layers; the checkpoint's `eagle_aux_hidden_state_layer_ids` where it names them),
laid side by side. The head runs as heads.py says.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.core.config import ModelConfig
from engine.layers.common import RMSNorm, RotaryEmbedding
from engine.models.hf_config import llama_like_fields
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.parallel.layers import ParallelLMHead, QKVParallelLinear, TPGroup, VocabParallelEmbedding
from engine.speculative.heads import HeadModel, HeadProposer

if TYPE_CHECKING:
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [normed embedding | normed hidden state], the hidden state as residual."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, TPGroup())
        self.self_attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                                    bias=cfg.qkv_bias)
        self.mlp = LlamaMLP(cfg, TPGroup())
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, embeds, hidden, kv_cache, meta, backend):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(rope, x, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """forward -> (normed, pre-norm) hidden states; the pre-norm one is the next draft step's input."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, target_hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(draft_vocab_size, cfg.hidden_size)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))

    @property
    def attention(self) -> LlamaAttention:
        return self.midlayer.self_attn

    def forward(self, input_ids, positions, hidden, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: (num_tokens, 3 * target hidden), the target's rows, or (num_tokens, hidden), the
        head's own pre-norm output of the step before; kv_cache: its one layer's slab."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        x, residual = self.midlayer(rope, self.embed_tokens(input_ids), hidden, kv_cache[0], meta, backend)
        return self.norm(x, residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The target's token ids of the head's greedy choices, (rows,)."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]

    def load_weights(self, weights) -> set[str]:
        params = {**dict(self.named_parameters()), "d2t": self.d2t}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            if name == "t2d":  # the reverse map (a mask over the target's vocabulary): unused
                continue
            args = ()
            for ckpt, (packed, shard) in self.packed_modules_mapping.items():
                if f".{ckpt}." in name:
                    name, args = name.replace(f".{ckpt}.", f".{packed}."), (shard,)
            if name not in params:
                raise KeyError(f"EAGLE-3 checkpoint tensor {name!r} has no parameter in the head")
            param = params[name]
            getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensor, *args)
            loaded.add(name)
        return loaded


def eagle3_config(folder: Path) -> tuple[ModelConfig, dict]:
    """The head's ModelConfig (one layer) and its config.json; refuses another layout in one line."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"--speculative-model {folder}: architecture {arch!r} is not an EAGLE-3 head "
                         f"({' or '.join(ARCHITECTURES)})")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"--speculative-model {folder}: an EAGLE-3 head has one layer, this one "
                         f"{cfg['num_hidden_layers']}")
    return ModelConfig(**llama_like_fields(cfg, folder.name), architecture="llama"), cfg


def aux_layers(cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (vLLM's default, or the checkpoint's)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 head: auxiliary layers {ids} are not three of the target's {num_target_layers}")
    return ids


def eagle3_rows(head_model: str, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head `head_model` reads."""
    from engine.loading.loader import resolve_model_path
    return aux_layers(eagle3_config(resolve_model_path(head_model))[1], num_target_layers)


def eagle3_taps(target: TargetRunner, head_model: str) -> _ResidualTaps:
    """The taps on the target's layers that give the head its rows (on a decode instance beside
    the head; on a prefill instance, to ship them)."""
    layers = target.model.layers
    if not all(isinstance(layer, LlamaDecoderLayer) for layer in layers):
        raise ValueError(f"--speculative-method eagle3: {target.model_config.name}'s layers are not Llama-like "
                         "(the head reads their residual stream)")
    return _ResidualTaps(layers, eagle3_rows(head_model, len(layers)))


def load_eagle3(target: TargetRunner):
    """The head beside the target's rank-0 runner (heads.HeadModel), its taps on the target's layers."""
    from engine.loading.loader import load_weights, resolve_model_path
    folder = resolve_model_path(target.config.speculative.model)
    cfg, raw = eagle3_config(folder)
    cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, target.configured_max_model_len))
    taps = eagle3_taps(target, str(folder))
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            head = Eagle3Head(cfg, raw.get("target_hidden_size") or target.model_config.hidden_size,
                              raw.get("draft_vocab_size") or cfg.vocab_size)
    finally:
        torch.set_default_dtype(torch.float32)
    loaded = head.load_weights((n, w.to(target.device)) for n, w in load_weights(folder, target.dtype))
    if "embed_tokens.weight" not in loaded:
        head.embed_tokens.weight.data.copy_(_target_embedding(target))
        loaded.add("embed_tokens.weight")
    missing = {n for n, _ in head.named_parameters()} - loaded
    if missing:
        raise ValueError(f"--speculative-model {folder}: the head lacks {sorted(missing)[:3]}")
    logger.info("speculative decoding: EAGLE-3 head %s on rank 0, reading the inputs of target layers %s",
                folder.name, list(taps.ids))
    return HeadModel(head.eval(), cfg, target, taps)


def _target_embedding(target: TargetRunner) -> torch.Tensor:
    """The target's whole embedding table (a TP rank holds a slice of its own: read from the checkpoint)."""
    if target.tp.size == 1:
        return target.model.embed_tokens.weight
    from engine.loading.loader import load_weights, resolve_model_path
    for name, tensor in load_weights(resolve_model_path(target.config.model), target.dtype):
        if name.removeprefix("model.") == "embed_tokens.weight":
            return tensor.to(target.device)
    raise ValueError(f"{target.config.model} has no embed_tokens.weight for the EAGLE-3 head")


class _ResidualTaps:
    """The residual stream entering three target layers, each forward: rows (num_tokens, 3 * hidden)."""

    def __init__(self, layers: nn.ModuleList, ids: tuple[int, ...]):
        self.ids, self.seen = ids, {}
        for i in sorted(set(ids)):
            layers[i].register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args):  # LlamaDecoderLayer.forward(rope, hidden, residual, ...)
            hidden, residual = args[1], args[2]
            self.seen[i] = hidden.clone() if residual is None else hidden + residual
        return hook

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([self.seen[i] for i in self.ids], dim=-1)
        self.seen = {}
        return rows


class Eagle3Proposer(HeadProposer):
    """EAGLE-3 (eagle3.py): its checkpoint is --speculative-model."""

    name = "eagle3"

    @classmethod
    def load_model(cls, target: TargetRunner) -> HeadModel:
        return load_eagle3(target)
