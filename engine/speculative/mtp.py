"""DeepSeek-V3's multi-token-prediction module (`--speculative-method mtp`): the layers past the last
of a checkpoint that has them (config.json `num_nextn_predict_layers`), as DeepSeek-V3 and R1 ship:

    model.layers.{L}.embed_tokens, enorm, hnorm, eh_proj (hidden, 2 * hidden)
    model.layers.{L}.<a decoder layer: latent attention and experts>
    model.layers.{L}.shared_head.norm, shared_head.head

    x = eh_proj([enorm(embed(token)) | hnorm(the target's final hidden state)])   (the embedding at position 0 is zero)
    pre = layer(x) + x's residual; draft = argmax head(shared_head.norm(pre))

The first module (L = num_hidden_layers) drafts every token, its `pre` standing in for the target's
hidden state after the first, as vLLM runs it. The head runs as heads.py says.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.common import RMSNorm
from engine.models.deepseek_v2 import DeepseekForCausalLM
from engine.speculative.heads import HeadModel, HeadProposer

if TYPE_CHECKING:
    from engine.core.config import ModelConfig
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)


class MtpHead(DeepseekForCausalLM):
    """The target's model of one (sparse) layer, with the module's input projection; `norm` and
    `lm_head` are the shared head's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)

    @property
    def attention(self) -> nn.Module:
        return self.layers[0].self_attn

    def forward(self, input_ids, positions, hidden, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(input_ids).masked_fill((positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self.layers[0](self.rotary.cos_sin(positions, x.dtype), x, None, kv_cache[0], meta, backend)
        pre = out + residual
        return self.norm(pre), pre

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).argmax(dim=-1)


def checkpoint_names(layer: int):
    """The checkpoint's MTP tensors of module `layer` -> the head's names (None: not the module's)."""
    prefix = f"model.layers.{layer}."
    shared = {"shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "lm_head.weight",
              "embed_tokens.weight": "model.embed_tokens.weight", "enorm.weight": "enorm.weight",
              "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}

    def rename(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        return shared.get(rest, "model.layers.0." + rest)
    return rename


def load_mtp(target: TargetRunner):
    """The target checkpoint's first MTP module beside its rank-0 runner (heads.HeadModel)."""
    from engine.layers.moe import select_expert_methods
    from engine.loading.loader import load_weights, resolve_model_path
    from engine.quant import process_weights_after_loading
    path, mc = resolve_model_path(target.config.model), target.model_config
    raw = json.loads((path / "config.json").read_text()) if path.is_dir() else {}
    if mc.architecture != "deepseek_v3" or not raw.get("num_nextn_predict_layers"):
        raise ValueError(f"--speculative-method mtp: {mc.name} has no multi-token-prediction module (a DeepSeek-V3 "
                         "HF checkpoint with num_nextn_predict_layers >= 1)")
    moe = replace(mc.moe, dense_layers=())  # the module's layer is sparse, as layer L of the model would be
    cfg = replace(mc, num_layers=1, moe=moe, max_position_embeddings=max(mc.max_position_embeddings,
                                                                          target.configured_max_model_len))
    rename = checkpoint_names(mc.num_layers)
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            head = MtpHead(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    weights = ((rename(n), w.to(target.device)) for n, w in load_weights(path, target.dtype, names=rename))
    loaded = head.load_weights(weights)
    missing = {n for n, _ in head.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{mc.name}: its MTP module lacks {sorted(missing)[:3]}")
    process_weights_after_loading(head)
    select_expert_methods(head, target.config.expert_method)
    logger.info("speculative decoding: DeepSeek MTP module (layer %d of the checkpoint) on rank 0", mc.num_layers)
    return HeadModel(head.eval(), cfg, target, final_hidden)


def final_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """The module reads the target's final (normed) hidden states."""
    return hidden


class MtpProposer(HeadProposer):
    """DeepSeek-V3's multi-token-prediction module (mtp.py), from the target's own checkpoint."""

    name = "mtp"

    @classmethod
    def load_model(cls, target: TargetRunner) -> HeadModel:
        return load_mtp(target)
