"""DeepSeek-V2 (and V2-Lite, V2.5): the Llama decoder with multi-head latent attention
(engine/layers/mla.py) in every layer and, past the first `first_k_dense_replace` layers, a mixture of
experts with always-on shared experts (ungated; `n_shared_experts` of them, one MLP as wide as
their sum) and DeepSeek's routing (engine/layers/routing.py): softmax scores, "greedy" top-k or
"group_limited_greedy" over `n_group` groups, the weights times `routed_scaling_factor`.

DeepSeek-V3 (engine/models/deepseek_v3.py) is this model with V3's router. transformers'
`modeling_deepseek_v2.py` / `_v3.py` are the reference (tests/engine/models/test_families.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from engine.core.config import MLAConfig, ModelConfig, MoEConfig
from engine.layers.common import RotaryEmbedding
from engine.layers.mla import MLAAttention, deinterleave_rows
from engine.models.hf_config import UnsupportedConfig, llama_like_fields, refuse
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

HF_ARCHITECTURE = "DeepseekV2ForCausalLM"
CHECKPOINT_QUANT = ("fp8",)  # block-quantized fp8 weights (DeepSeek-V3's format), dequantized on load
TOPK_METHODS = ("greedy", "group_limited_greedy")  # transformers' DeepseekV2TopkRouter


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention = MLAAttention


class DeepseekForCausalLM(LlamaForCausalLM):
    decoder_layer = DeepseekDecoderLayer
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        mla = cfg.mla  # the rotary embedding turns the rope dims alone
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if (block := self.config.fp8_weight_block) is not None:
            from engine.quant.fp8_block import with_fp8_blocks_dequantized
            weights = with_fp8_blocks_dequantized(weights, block, self.embed_tokens.weight.dtype)
        return super().load_weights(self._as_loaded(weights))

    def _as_loaded(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model's layers take them: the multi-token-prediction
        layers past the last (which transformers ignores too) dropped, `shared_experts` under the
        block's `shared_expert`, and the rotary rows of q and of the latent's projection from
        interleaved pairs to halves (engine/layers/mla.py)."""
        mla, layers = self.config.mla, self.config.num_layers
        for name, tensor in weights:
            parts = name.removeprefix("model.").split(".")
            if parts[0] == "layers" and int(parts[1]) >= layers:
                continue
            name = name.replace(".shared_experts.", ".shared_expert.")
            if mla.rope_interleave and name.endswith((".q_proj.weight", ".q_b_proj.weight")):
                tensor = deinterleave_rows(tensor, mla.qk_rope_head_dim, mla.qk_head_dim)
            elif mla.rope_interleave and name.endswith(".kv_a_proj_with_mqa.weight"):
                tensor = deinterleave_rows(tensor, mla.qk_rope_head_dim, mla.entry_size)
            yield name, tensor


MODEL = DeepseekForCausalLM


def deepseek_fields(cfg: dict, name: str, rope_interleave: bool) -> dict:
    """The `ModelConfig` keyword arguments V2 and V3 share: Llama's, the latent attention's shape
    (the cache's one KV head of half an entry: engine/layers/mla.py) and the dense layers' count."""
    if cfg.get("attention_bias"):
        raise refuse(name, "attention_bias true in a DeepSeek model")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise refuse(name, f"moe_layer_freq {cfg['moe_layer_freq']!r} (every layer past first_k_dense_replace "
                           "is sparse here)")
    mla = MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or None, rope_interleave=rope_interleave)
    if mla.entry_size % 2:
        raise UnsupportedConfig(f"{name}: kv_lora_rank + qk_rope_head_dim = {mla.entry_size} is odd (the cache "
                                "holds a token's latent entry in two halves)")
    fields = llama_like_fields(cfg, name)
    return {**fields, "num_kv_heads": 1, "head_dim": mla.entry_size // 2, "mla": mla,
            "fp8_weight_block": fp8_weight_block(cfg, name)}


def fp8_weight_block(cfg: dict, name: str) -> tuple[int, int] | None:
    """A `quant_method: fp8` checkpoint's block size (its weights e4m3 with a scale per block:
    engine/quant/fp8_block.py); None for float weights. Other fp8 layouts are refused by name."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if quant.get("fmt", "e4m3") != "e4m3" or not quant.get("weight_block_size"):
        raise refuse(name, f"fp8 checkpoint {quant!r} (pdserve loads e4m3 weights with weight_block_size)")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def deepseek_moe(cfg: dict, name: str, routing: str, renormalize: bool) -> MoEConfig | None:
    """The mixture past the first `first_k_dense_replace` layers (None: no routed experts, or every
    layer dense)."""
    if not cfg.get("n_routed_experts") or (cfg.get("first_k_dense_replace") or 0) >= cfg["num_hidden_layers"]:
        return None
    groups = cfg.get("n_group") or 1
    return MoEConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["moe_intermediate_size"], renormalize=renormalize,
                     shared_expert_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                     dense_layers=tuple(range(min(cfg.get("first_k_dense_replace") or 0, cfg["num_hidden_layers"]))),
                     routing=routing, num_groups=groups, topk_groups=cfg.get("topk_group") or groups,
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), shared_expert_gate=False)


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    method = cfg.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise refuse(name, f"topk_method {method!r} in DeepSeek-V2 (it routes {', '.join(TOPK_METHODS)})")
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise refuse(name, f"scoring_func {cfg['scoring_func']!r} in DeepSeek-V2")
    if cfg.get("norm_topk_prob"):  # DeepSeek's own code would renormalize; transformers' V2 never does
        raise refuse(name, "norm_topk_prob true in DeepSeek-V2 (transformers' V2 router ignores it)")
    routing = "group_limited_greedy" if method == "group_limited_greedy" else "softmax"
    return ModelConfig(**deepseek_fields(cfg, name, rope_interleave=True), architecture="deepseek_v2",
                       moe=deepseek_moe(cfg, name, routing, renormalize=False))
