"""Frozen configuration of the engine: the model's shape, the KV cache, the scheduler.

Runtime values that depend on the machine (the number of KV blocks that fit) live in
`CacheConfig.num_blocks` once resolved by the model runner, never in module globals.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.expert_placement import ExpertPlacement
from engine.core.speculative_config import SHIPPED as SPECULATIVE_SHIPPED  # noqa: F401 (the spec's)
from engine.core.speculative_config import METHODS as SPECULATIVE_METHODS  # noqa: F401 (the spec's choices)
from engine.core.speculative_config import SpeculativeConfig


def window_start(num_tokens: int, kv_window: int | None) -> int:
    """The first prompt position a decode step can still read after a prompt of `num_tokens`: its
    first query (position num_tokens) sees the `kv_window` keys ending at it. 0 without a window."""
    return 0 if kv_window is None else max(0, num_tokens - kv_window + 1)



def cache_dir() -> Path:
    """Where pdserve keeps what it derives from its inputs (converted GGUFs, measured linear kernels,
    the KV disk tier unless given a directory): `$PDSERVE_CACHE_DIR`, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", "~/.cache/pdserve")).expanduser()

@dataclass(frozen=True)
class KVLayout:
    """How a model's layers use the paged KV pool (vLLM's KV cache groups).

    Layers with the same window form groups of equal size (the gcd of the counts per window:
    Gemma 2's 13 sliding and 13 global layers make two groups of 13). Each group has its own
    block table per request, so a sliding group frees the blocks its window left behind while a
    global group keeps them. The pool has `num_slabs` (the group size) layer slabs: block b of
    slab s holds the K/V of layer `groups[g][s]` for whichever group g holds block b, so a block
    is one group's worth of layers. One group (every layer alike): slab i is layer i.
    """
    groups: tuple[tuple[int, ...], ...]  # per group, its layers in order
    windows: tuple[int | None, ...]  # per group, its layers' window (None: full attention)

    @classmethod
    def of(cls, windows: list[int | None]) -> KVLayout:
        """The layout of layers with these windows (one per layer)."""
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            by_window.setdefault(w, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        chunks = [(layers[i:i + size], w) for w, layers in by_window.items() for i in range(0, len(layers), size)]
        chunks.sort(key=lambda c: c[0][0])
        return cls(tuple(tuple(c) for c, _ in chunks), tuple(w for _, w in chunks))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slabs(self) -> int:
        return len(self.groups[0])

    @functools.cached_property
    def place(self) -> dict[int, tuple[int, int]]:
        """layer -> (its group, its slab)."""
        return {layer: (g, s) for g, layers in enumerate(self.groups) for s, layer in enumerate(layers)}

    @property
    def signature(self) -> str:
        """The windows and group sizes, for both ends of a KV transfer to compare: "512x13,fullx13"."""
        return ",".join(f"{'full' if w is None else w}x{len(g)}" for g, w in zip(self.groups, self.windows))


ROUTINGS = ("softmax", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (engine/layers/mla.py): a token's keys and values are one
    latent, `kv_lora_rank` wide (normed), plus a rotary key `qk_rope_head_dim` wide shared by every
    head; the KV cache holds those two, not per-head K and V."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # the query's low-rank projection (None: one q_proj, as V2-Lite)
    rope_interleave: bool = True  # the checkpoint's rotary dims in (x0, x1) pairs (V2 always; V3's switch)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def entry_size(self) -> int:
        """A token's cache entry per layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (engine/layers/moe.py): which layers have one, and its router's switches."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    renormalize: bool  # the chosen experts' softmax weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, gated by a sigmoid; 0: none
    sparse_step: int = 1  # every sparse_step-th layer is sparse (Qwen's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP all the same (Qwen's mlp_only_layers)
    # gpt-oss: the router's linear and every expert's projections carry biases, and the experts'
    # activation is its clamped SwiGLU over interleaved gate/up rows (engine/layers/expert_compute.py ACTIVATIONS)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    # DeepSeek (engine/layers/moe.py route): "softmax" top-k (every family before it; DeepSeek-V2's greedy),
    # "group_limited_greedy" (V2: softmax, the experts of the `topk_groups` groups with the highest
    # best score), "noaux_tc" (V3: sigmoid scores, chosen on score + the router's
    # e_score_correction_bias, groups ranked by their two best); the chosen weights (after any
    # renormalizing) times routed_scaling_factor
    routing: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on its shared expert; DeepSeek's have none

    def __post_init__(self):
        assert 0 < self.top_k <= self.num_experts, "top_k must be in 1..num_experts"
        assert self.sparse_step >= 1
        assert self.routing in ROUTINGS, self.routing
        assert self.num_experts % self.num_groups == 0 and 0 < self.topk_groups <= self.num_groups

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a model and the switches of its family (engine/models), read from GGUF metadata or
    a HF `config.json`; a switch a checkpoint sets that its family does not implement is refused
    there, at load, so nothing here is silently ignored."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF-style {"rope_type": "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "llama"
    architecture: str = "llama"  # the family (engine/models.FAMILIES)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # o_proj carries one (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down carry one (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary embedding (Qwen3)
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    # per layer, "full_attention" or "sliding_attention" (HF `layer_types`); () = every layer full,
    # or every layer sliding when sliding_window is set
    layer_types: tuple[str, ...] = ()
    # every id that ends generation: the config's, generation_config's and the tokenizer's (the one EOS set:
    # loaders fill it, eos_token_id is always in it, every worker and the grammar read it)
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2's: tanh soft-capping of attention scores and of the final logits (cap * tanh(x / cap)),
    # and the softmax scale query_pre_attn_scalar ** -0.5 in place of head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    # Gemma 3's sliding layers rotate with their own base and scaling (rope_local_base_freq; transformers
    # 5's rope_parameters["sliding_attention"]); None: every layer rotates with rope_theta / rope_scaling
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict | None = None
    moe: MoEConfig | None = None  # the sparse MLP of a mixture-of-experts family; None: dense
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    # DeepSeek's latent attention; then the KV cache is one "KV head" whose two planes hold a token's
    # entry (latent | rotary key) in halves: num_kv_heads 1, head_dim mla.entry_size // 2
    mla: MLAConfig | None = None
    # a checkpoint's fp8 weights in blocks of (rows, columns), each with a scale (DeepSeek-V3's
    # quantization_config weight_block_size; engine/quant/fp8_block.py): dequantized on load
    fp8_weight_block: tuple[int, int] | None = None

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        assert self.head_dim % 2 == 0
        assert not self.layer_types or len(self.layer_types) == self.num_layers, "one layer type per layer"
        if self.mla is not None:
            assert self.num_kv_heads == 1 and 2 * self.head_dim == self.mla.entry_size, "MLA's cache is its entry"
        if self.eos_token_id is not None and self.eos_token_id not in self.eos_token_ids:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id, *self.eos_token_ids))

    def tp_misfit(self, tp: int, expert_parallel: bool = False) -> str | None:
        """Why `tp` tensor-parallel ranks cannot split this model (None: they can), as
        QKVParallelLinear and the MLP shard it; with `expert_parallel`, the experts whole."""
        if self.num_heads % tp:
            return f"its {self.num_heads} attention heads do not split over {tp} ranks"
        if tp >= self.num_kv_heads and tp % self.num_kv_heads:
            return f"{tp} ranks are not a multiple of its {self.num_kv_heads} KV heads"
        if tp < self.num_kv_heads and self.num_kv_heads % tp:
            return f"its {self.num_kv_heads} KV heads do not split over {tp} ranks"
        if self.intermediate_size % tp:
            return f"its MLP width {self.intermediate_size} does not split over {tp} ranks"
        if expert_parallel and self.moe is None:
            return "expert parallelism needs a mixture of experts, and it has none"
        if self.moe is not None:
            if expert_parallel and self.moe.num_experts < tp:
                return f"its {self.moe.num_experts} experts are fewer than {tp} expert-parallel ranks"
            widths = (() if expert_parallel else (("expert", self.moe.intermediate_size),)) + \
                (("shared expert", self.moe.shared_expert_intermediate_size),)
            for what, width in widths:
                if width % tp:
                    return f"its {what} width {width} does not split over {tp} ranks"
        return None

    @property
    def sparse_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts ([] for a dense model)."""
        return [] if self.moe is None else [i for i in range(self.num_layers) if self.moe.is_sparse(i)]

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """Which layers share a block table (engine/core/config.py KVLayout), from their windows."""
        return KVLayout.of([self.window(i) for i in range(self.num_layers)])

    def window(self, layer: int) -> int | None:
        """How many keys (its own included) a query of `layer` attends to; None: all before it."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope(self, layer_type: str) -> tuple[float, dict | None]:
        """The rotary base and scaling of the layers of `layer_type` (a `layer_types` entry)."""
        if layer_type == "sliding_attention" and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def kv_format(self) -> str:
        """What a KV head's two planes hold, for the KV transfer's handshake (kvtransfer/params.py)."""
        return "kv" if self.mla is None else f"mla:{self.mla.kv_lora_rank}+{self.mla.qk_rope_head_dim}"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


DTYPE_CHOICES = ("auto", *DTYPES)

# auto keeps the checkpoint's format (a GGUF's Q4_0/Q4_1/Q4_K linears run int4 as they are, anything
# else unquantized), none forces unquantized; int8 (weights), w8a8 (weights and activations) and
# int4 (group-wise Q4_1 weights) of float weights are opt-in lossy conversions at load (engine/quant).
QUANTIZATION_CHOICES = ("auto", "none", "int8", "w8a8", "int4")

# How a mixture's experts are computed: engine/layers/expert_compute.py METHOD_CHOICES (tests/engine/layers/test_moe.py
# checks the two agree).
EXPERT_METHOD_CHOICES = ("auto", "loop", "grouped_mm", "vllm_cpu")

# The KV cache's element type, when it is not the model's (vLLM's --kv-cache-dtype names).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" is the model's dtype (the cache holds K/V as computed); "fp8_e4m3" stores them in
    float8_e4m3fn, 1 byte per element, scaled per layer and dequantized on read."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return KV_CACHE_DTYPES[name]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} (or auto)")
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """oneDNN's bf16 kernels need avx512bw/vl/dq (or avx_ne_convert); elsewhere bf16 is emulated."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on CUDA and on CPUs with native bf16, else float32: on an AVX2-only CPU bf16
    matmuls are emulated and several times slower than fp32 (measured: 10-17 vs 57-70 GFLOP/s)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # A fixed number of blocks (of the block size the attention backend uses), else a budget the
    # runner derives it from: on a GPU, this fraction of the device's memory for this instance's
    # process (weights, activation peak and KV); on a CPU, memory_gib of KV.
    num_blocks: int | None = None
    memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # see resolve_kv_cache_dtype
    kv_delta: bool = True  # a decode instance takes a remote prompt's leading blocks from its prefix cache
    host_tier_gib: float = 0.0  # a host-memory tier under the pool (engine/core/host_tier.py); 0: none
    disk_tier_gib: float = 0.0  # a disk tier under the host tier (engine/runner/disk_tier.py); 0: none
    disk_tier_dir: str | None = None  # its directory; None: $PDSERVE_CACHE_DIR/kv (~/.cache/pdserve/kv)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048  # token budget per step; long prompts are chunked to fit
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # see resolve_dtype
    device: str = "auto"  # auto = cuda when present, else cpu
    attention_backend: str = "auto"  # auto = flash_attn on CUDA, else flex; vllm_cpu on a CPU where it fits, else torch
    num_threads: int | None = None  # the step thread's intra-op threads; None: torch's default (CPU), 1 (GPU)
    adapt_threads: bool = False  # CPU: num_threads is a most; fewer while other processes take cores (TeamSizer)
    tp_size: int = 1
    expert_parallel: bool = False  # the TP ranks partition a mixture's experts, not split each (engine/layers/moe.py)
    expert_placement: ExpertPlacement | None = None  # with expert_parallel; None: contiguous runs of experts
    expert_method: str = "auto"  # how experts are computed: auto (measured), loop, grouped_mm, vllm_cpu
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    batch_invariant: bool = False  # each row's numbers independent of its batch (engine/quant/batch_invariant.py)
    quantization: str = "auto"  # linear method: auto (the checkpoint's format), none, int8, w8a8, int4
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding on a decode (or colocated) instance
    # a prefill instance: its decode instances' speculative decoding, when their proposer needs
    # state of the prompt (a draft model's KV, a head's rows): rank 0 computes it and ships it with the KV
    ship_proposer_rows: SpeculativeConfig | None = None
