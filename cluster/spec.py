"""The cluster spec: every knob of `pdserve serve`, from defaults, a YAML file and CLI flags.

`ClusterSpec` is flat so that each field is exactly one YAML key and one `--flag-name`;
the engine's own frozen configs (`EngineConfig`, `CacheConfig`, `SchedulerConfig`) are derived
from it per role by `engine_config(role)`. Precedence: explicit CLI flag > YAML > default.

A leaf module: any layer may import it. It imports only `engine` (whose configs it composes, and
the attention backends' names), nothing else of ours. Each key's choices are in `CHOICES`; the
registries above this floor are built with `spec_registry`, so they take exactly those names. The
flags themselves (help, which command takes which): cluster/cli/flags.py.
"""
from __future__ import annotations

import argparse
import functools
import re
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import yaml

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.core.config import (DTYPE_CHOICES, EXPERT_METHOD_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES,
                                SPECULATIVE_SHIPPED, SPECULATIVE_METHODS, CacheConfig, EngineConfig, SchedulerConfig,
                                SpeculativeConfig)
from engine.core.tracing import TracingConfig
from engine.core.expert_placement import ExpertPlacement

MODES = ("disaggregated", "colocated")
ROLES = ("prefill", "decode", "colocated")
# The names of the registries above this leaf, which it cannot import: declared here once, and each
# registry is built with `spec_registry("<key>", ...)`, which refuses at import one that names others.
ROUTER_POLICIES = ("least_loaded", "prefix_aware", "round_robin")  # router/policy.py ROUTING_POLICIES
AUTOSCALE_POLICIES = ("slo", "queue")  # cluster/autoscale/factory.py POLICIES
AUTOSCALE_ACTUATORS = ("ray", "kubernetes", "dry_run")  # cluster/autoscale/factory.py ACTUATORS
AUTOSCALE_FORECASTS = ("mean", "trend")  # cluster/autoscale/forecast.py FORECASTS
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # gateway/tool_parsers.py TOOL_PARSERS
REASONING_PARSERS = ("deepseek_r1", "openai_gptoss", "qwen3")  # gateway/reasoning.py REASONING_PARSERS
# kvtransfer/registry.py TRANSPORTS (auto: same-device pairs write into the cache; nixl: the decode reads over NIXL)
KV_TRANSPORTS = ("auto", "torch", "nixl")
# Names with no registry of their own: the code that reads them imports them from here.
KV_LOAD_FAILURE_POLICIES = ("recompute", "retry")  # cluster/control/frontend.py: a decode instance's failed KV load
WAIT_POLICIES = ("passive", "active", "inherit")  # cluster/ranks/cpu_plan.py: OMP_WAIT_POLICY of rank processes
SESSION_AFFINITY = ("header", "user", "off")  # gateway/app.py: what names a request's session (router/policy.py)
WORKER_PODS = ("per_role", "shared")  # cluster/ranks/nodes.py role_resource: the Ray resource a rank asks for

STATE_URL_SCHEMES = ("memory://", "redis://", "rediss://", "unix://")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# The choices of each key that has a fixed set (None too where the key is optional).
CHOICES = MappingProxyType({
    "dtype": DTYPE_CHOICES, "mode": MODES, "router_policy": ROUTER_POLICIES, "attention_backend": ATTENTION_BACKENDS,
    "autoscale_policy": AUTOSCALE_POLICIES, "autoscale_actuator": AUTOSCALE_ACTUATORS,
    "autoscale_forecast": AUTOSCALE_FORECASTS, "worker_pods": WORKER_PODS,
    "kv_load_failure_policy": KV_LOAD_FAILURE_POLICIES, "kv_transport": KV_TRANSPORTS,
    "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES, "quantization": QUANTIZATION_CHOICES, "omp_wait_policy": WAIT_POLICIES,
    "expert_method": EXPERT_METHOD_CHOICES, "speculative_method": SPECULATIVE_METHODS,
    "tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS,
    "session_affinity": SESSION_AFFINITY,
})
_Entry = TypeVar("_Entry")


def spec_registry(key: str, entries: Mapping[str, _Entry]) -> Mapping[str, _Entry]:
    """A registry of what the spec's `key` names, read-only.

    Args:
        key: a key of `CHOICES` (e.g. "router_policy").
        entries: name -> what it names (a class, a parser, a factory).
    Returns:
        `entries`, read-only. Raises RuntimeError (at the registry's import) when its names are not
        exactly `CHOICES[key]`: the spec's list and the registry cannot drift apart.
    """
    if set(entries) != set(CHOICES[key]):
        raise RuntimeError(f"{key}: the registry names {', '.join(sorted(entries))}, the spec "
                           f"{', '.join(sorted(CHOICES[key]))} (cluster/spec.py); make them one set")
    return MappingProxyType(dict(entries))


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
    expert_placement: str | None = None  # a JSON file of engine/core/expert_placement.py ExpertPlacement
    expert_method: str = "auto"  # engine/layers/expert_compute.py METHOD_CHOICES
    speculative_method: str | None = None  # engine/core/speculative_config.py METHODS
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
    session_affinity: str = "header"  # a session's next request where its last ran: x-session-id, or also `user`
    router_max_queued: int = 4096  # router/flow.py: requests of one priority class queued (more: 429)
    router_queue_timeout_s: float = 60.0  # how long one may wait for a decode instance to take it (then 503)
    disagg_threshold_tokens: int = 0
    kv_transfer_timeout_s: float = 10.0
    kv_transport: str = "auto"
    kv_checksum: bool = False  # kvtransfer/wire.py: a checksum per part, checked on receipt
    kv_delta: bool = True  # decode_worker/scheduler.py reserve: ship only what the decode's prefix cache lacks
    kv_fetch: bool = True  # router/fetch.py: a prefix another instance holds is fetched when that pays
    kv_host_tier_gib: float = 0.0  # engine/core/host_tier.py: evicted blocks' KV kept in host memory; 0: none
    kv_disk_tier_gib: float = 0.0  # engine/runner/disk_tier.py: what the host tier drops, on disk; 0: none
    kv_disk_tier_dir: str | None = None  # its directory (a shared volume shares it); None: $PDSERVE_CACHE_DIR/kv
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
    ray_resources: bool = False  # Kubernetes: actors land on worker pods carrying `prefill`/`decode` (or `worker`)
    worker_pods: str = "per_role"  # with ray_resources: per_role pods carry one role's resource, shared pods `worker`
    # observability (engine/core/tracing.py, gateway/trace.py): OTLP/HTTP traces, off without an endpoint
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0  # of new traces (a client's traceparent decides its own)
    return_timings: bool = False  # each answer's usage carries its phase times (and a Server-Timing header)
    # autoscaling (cluster/autoscale/autoscaler.py)
    autoscale: bool = False
    autoscale_policy: str = "slo"
    autoscale_actuator: str = "ray"
    autoscale_interval_s: float = 10.0
    autoscale_profile: str | None = None
    autoscale_forecast: str = "trend"  # the arrival rate one cold start ahead (cluster/autoscale/forecast.py)
    ttft_slo_s: float = 2.0
    tbt_slo_s: float = 0.1
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_instances: int = 0  # both pools together (a fixed fleet: a pool grows by flipping); 0: no bound
    scale_headroom: float = 0.2
    scale_up_cooldown_s: float = 10.0
    scale_down_cooldown_s: float = 60.0
    k8s_namespace: str | None = None
    k8s_prefill_deployment: str = "pdserve-prefill"
    k8s_decode_deployment: str = "pdserve-decode"
    k8s_worker_deployment: str = "pdserve-worker"  # worker_pods shared: the one worker Deployment

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
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices and not (value is None and _optional(_field_types()[name])):
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
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
                     "expert_placement", "speculative_model", "api_keys_file", "kv_disk_tier_dir",
                     "k8s_prefill_deployment", "k8s_decode_deployment", "k8s_worker_deployment",
                     "otlp_traces_endpoint"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")
        if not 0 < self.trace_sample_ratio <= 1:
            raise ValueError(f"trace_sample_ratio must be in (0, 1], got {self.trace_sample_ratio}")
        self.tracing  # raises on an endpoint that is no http(s) URL

    def _check_ranges(self) -> None:
        minimum = {"num_decode": 1, "prefill_tp": 1, "decode_tp": 1, "port": 0, "block_size": 1,
                   "num_kv_blocks": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1, "num_threads": 1,
                   "cpus_per_rank": 1, "reserved_cpus": 0, "rank_niceness": -20,
                   "disagg_threshold_tokens": 0, "kv_recompute_max_tokens": 0,
                   "max_request_bytes": 1, "max_prompt_tokens": 1, "router_max_queued": 1,
                   "num_prefill": 1 if self.mode == "disaggregated" else 0,
                   "min_prefill": 0, "min_decode": 1, "max_prefill": self.min_prefill, "max_decode": self.min_decode,
                   "max_instances": self.min_prefill + self.min_decode if self.max_instances else 0}
        for name, low in minimum.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name in ("kv_memory_gib", "kv_transfer_timeout_s", "heartbeat_ttl_s", "autoscale_interval_s",
                     "ttft_slo_s", "tbt_slo_s", "request_timeout_s", "router_queue_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("scale_headroom", "scale_up_cooldown_s", "scale_down_cooldown_s", "drain_timeout_s",
                     "kv_host_tier_gib", "kv_disk_tier_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_disk_tier_gib > 0 and self.kv_host_tier_gib <= 0:
            raise ValueError(f"kv_disk_tier_gib {self.kv_disk_tier_gib:g} needs kv_host_tier_gib > 0 "
                             "(the disk tier takes the blocks the host tier drops)")
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
    def tracing(self) -> TracingConfig | None:
        """Where every process of the cluster sends its spans (None: tracing off)."""
        if self.otlp_traces_endpoint is None:
            return None
        return TracingConfig(self.otlp_traces_endpoint, self.trace_sample_ratio)

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
                           enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
                           kv_delta=self.kv_delta, host_tier_gib=self.kv_host_tier_gib,
                           disk_tier_gib=self.kv_disk_tier_gib, disk_tier_dir=self.kv_disk_tier_dir)

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
        """Builds the spec from a namespace parsed with cluster/cli/flags.py `add_cli_flags`: explicit flags
        override the `--config` YAML, which overrides the defaults."""
        config = getattr(args, "config", None)
        base = cls.from_yaml(config) if config else cls()
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return replace(base, **given)


@functools.cache
def _field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(ClusterSpec)


def _optional(tp) -> bool:
    return type(None) in typing.get_args(tp)


def _base_type(tp) -> type:
    """int for `int` and `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def key_type(name: str) -> type:
    """The type of the spec key `name`, None apart: int for `num_kv_blocks: int | None`."""
    return _base_type(_field_types()[name])
