"""Prometheus metrics of one gateway: request outcomes and latencies it observes, plus the
router's queue and every instance's load figures, read at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

API_KEY_OUTCOMES = ("served", "unauthorized", "rate_limited", "concurrency_limited", "token_limited", "too_large",
                    "bad_request")
# a generation request's outcome by class and key (pdserve_tenant_requests_total): submitted to the router;
# refused for a full queue (429) or its key's token budget (429); waited past the queue's deadline (503)
TENANT_OUTCOMES = ("admitted", "queue_full", "token_limited", "queue_timeout")
MAX_CLASS_LABEL = 99  # priority classes beyond +-99 share the label ">99" / "<-99" (bounded series)
# a request's phases the phase histogram labels (`usage.timings` adds ttft and e2e): gateway/trace.py
REQUEST_PHASES = ("prepare", "queue", "prefill_queue", "prefill", "kv_transfer", "decode")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# load key -> (metric name, help); every instance reports these through `load()`
INSTANCE_GAUGES = {
    "running": ("pdserve_instance_running_requests", "sequences in the running batch"),
    "waiting": ("pdserve_instance_waiting_requests", "requests waiting to be scheduled"),
    "reserved": ("pdserve_instance_reserved_requests", "decode: requests whose KV is still arriving"),
    "queued_prefill_tokens": ("pdserve_instance_queued_prefill_tokens", "prefill: prompt tokens not yet computed"),
    "kv_usage": ("pdserve_instance_kv_usage_ratio", "fraction of KV blocks in use"),
    "num_preemptions": ("pdserve_instance_recomputes_total", "preemptions by recompute, since start"),
    "kv_bytes_sent": ("pdserve_kv_transfer_sent_bytes_total",
                      "KV bytes sent, since start (a decode instance's: of its cache, for fetches)"),
    "kv_bytes_received": ("pdserve_kv_transfer_received_bytes_total", "KV bytes received, since start"),
    "kv_reused_prompt_tokens": ("pdserve_kv_reused_prompt_tokens_total",
                                "decode: remote prompts' tokens its prefix cache held, so not shipped (delta transfer)"),
    "kv_host_tier_blocks": ("pdserve_kv_host_tier_blocks", "KV blocks its host tier holds (--kv-host-tier-gib)"),
    "kv_host_tier_slots": ("pdserve_kv_host_tier_capacity_blocks", "KV blocks its host tier can hold"),
    "kv_host_tier_offloaded_blocks": ("pdserve_kv_host_tier_offloaded_blocks_total",
                                      "KV blocks copied to the host tier (evicted; a decode instance's: cached)"),
    "kv_host_tier_reloaded_blocks": ("pdserve_kv_host_tier_reloaded_blocks_total",
                                     "KV blocks copied back from the host tier for a prompt (not computed)"),
    "kv_host_tier_dropped_blocks": ("pdserve_kv_host_tier_dropped_blocks_total",
                                    "KV blocks the full host tier dropped (least recently used)"),
    "prefill_tokens_computed": ("pdserve_prefill_computed_tokens_total", "prefill: prompt tokens computed, since start"),
    "prefill_busy_s": ("pdserve_prefill_busy_seconds_total", "prefill: seconds its steps took, since start"),
    "kv_host_tier_offload_seconds": ("pdserve_kv_host_tier_offload_seconds_total",
                                     "seconds rank 0 spent copying KV blocks to the host tier"),
    "kv_host_tier_reload_seconds": ("pdserve_kv_host_tier_reload_seconds_total",
                                    "seconds rank 0 spent copying KV blocks back from the host tier"),
    "kv_disk_tier_read_seconds": ("pdserve_kv_disk_tier_read_seconds_total",
                                  "seconds spent reading and checking KV blocks loaded from the disk tier"),
    "kv_disk_tier_blocks": ("pdserve_kv_disk_tier_blocks", "KV blocks its disk tier holds (--kv-disk-tier-gib)"),
    "kv_disk_tier_bytes": ("pdserve_kv_disk_tier_bytes", "bytes of its disk tier's files"),
    "kv_disk_tier_spilled_blocks": ("pdserve_kv_disk_tier_spilled_blocks_total",
                                    "KV blocks the full host tier wrote to the disk tier"),
    "kv_disk_tier_loaded_blocks": ("pdserve_kv_disk_tier_loaded_blocks_total",
                                   "KV blocks read back from the disk tier for a prompt (not computed)"),
    "kv_disk_tier_refused_blocks": ("pdserve_kv_disk_tier_refused_blocks_total",
                                    "disk tier files refused: corrupt, truncated, or another model's or KV format's"),
    "kv_disk_tier_deleted_blocks": ("pdserve_kv_disk_tier_deleted_blocks_total",
                                    "disk tier files deleted when full (least recently used)"),
    "kv_disk_tier_write_failures": ("pdserve_kv_disk_tier_write_failures_total",
                                    "disk tier writes that failed (read-only or full directory: writes stop)"),
    "kv_host_tier_write_through_skipped": ("pdserve_kv_host_tier_write_through_skipped_blocks_total",
                                           "decode: cached KV blocks not copied to the host tier (the pool was short first)"),
    "kv_transfer_seconds": ("pdserve_kv_transfer_seconds_total", "seconds spent in acknowledged KV transfers"),
    "kv_fetches": ("pdserve_kv_fetches_total", "prefill: prompt prefixes fetched from another instance (not computed)"),
    "kv_fetched_tokens": ("pdserve_kv_fetched_tokens_total", "prefill: prompt tokens whose KV was fetched"),
    "kv_fetch_seconds": ("pdserve_kv_fetch_seconds_total", "prefill: seconds from a fetch's admission to its KV complete"),
    "kv_fetches_failed": ("pdserve_kv_fetches_failed_total", "prefill: fetches given up (refused, failed, late): computed"),
    "kv_fetch_bytes_received": ("pdserve_kv_fetch_bytes_received_total", "prefill: KV bytes received by fetches"),
    "kv_transfer_failures": ("pdserve_kv_transfer_failures_total", "failed or rejected KV transfers"),
    "kv_messages_dropped": ("pdserve_kv_messages_dropped_total", "malformed KV control messages or parts for unknown requests"),
    "kv_peers_refused": ("pdserve_kv_peers_refused_total",
                         "KV control connections refused: no proof of the cluster secret, or a message failing its MAC"),
    "kv_checksum_mismatches": ("pdserve_kv_checksum_mismatches_total",
                               "KV parts whose checksum did not match (--kv-checksum): failed and retried"),
    "kv_mac_mismatches": ("pdserve_kv_mac_mismatches_total",
                          "KV parts whose payload MAC did not match (altered in flight): failed and retried"),
    "spec_max_batch": ("pdserve_spec_decode_max_batch_size",
                       "speculative decoding: most decoding sequences a step speculates with (measured)"),
    "spec_rows_received": ("pdserve_spec_decode_prompt_rows_received_total",
                           "speculative decoding: prompt positions whose proposer state came with a remote prefill's KV"),
}
# load key prefix -> (metric name, help): a figure per sparse layer of a mixture of experts, labelled
# with the layer (engine/layers/moe.py expert_load_figures)
LAYER_GAUGES = {
    "expert_imbalance/": ("pdserve_instance_expert_imbalance_ratio",
                          "max over mean of the tokens routed to each expert of a layer, since start"),
    "expert_rank_imbalance/": ("pdserve_instance_expert_rank_imbalance_ratio",
                               "expert parallelism: max over mean of the tokens each rank computes in a layer"),
}
# load key prefix -> (metric name, help, kind): speculative decoding, per method and draft position
# (engine/speculative/speculator.py figures: "spec_proposed/<method>/<position>")
SPEC_FIGURES = {
    "spec_proposed": ("pdserve_spec_decode_proposed_tokens", "drafts proposed at this position, since start",
                      CounterMetricFamily),
    "spec_accepted": ("pdserve_spec_decode_accepted_tokens", "drafts accepted at this position, since start",
                      CounterMetricFamily),
    "spec_acceptance": ("pdserve_spec_decode_acceptance_ratio", "drafts accepted over proposed at this position",
                        GaugeMetricFamily),
}
# router counter -> (metric name, help): every failure path the router handles
ROUTER_COUNTERS = {
    "retries": ("pdserve_router_retries", "request attempts placed again after a failure"),
    "failed": ("pdserve_router_failed_requests", "requests that ended with an error after their retries"),
    "instance_deaths": ("pdserve_router_instance_deaths", "instances found dead (their requests were retried)"),
    "queue_timeouts": ("pdserve_router_queue_timeouts", "requests that waited in the router's queue past its "
                                                        "deadline (every decode instance full): 503"),
    "tokens_past_stop": ("pdserve_router_tokens_past_stop", "tokens generated after the gateway matched a stop "
                                                              "string, before the abort reached the instance"),
    "kv_recomputes": ("pdserve_router_kv_recomputes", "remote requests whose KV a decode instance expected from a "
                                                      "prefill instance and recomputed instead (the transfer failed)"),
    "prompt_tokens": ("pdserve_router_prompt_tokens", "prompt tokens of the requests placed (first attempts)"),
    "cached_prompt_tokens": ("pdserve_router_cached_prompt_tokens", "of those, the tokens an instance's prefix "
                                                                    "cache served (first attempts)"),
    "prefix_available_tokens": ("pdserve_router_prefix_available_tokens",
                                "prompt tokens the prefix cache of any instance that could compute the prompt "
                                "held (first attempts; prefix_aware: its index)"),
    "prefix_routed_tokens": ("pdserve_router_prefix_routed_tokens",
                             "of those, the tokens the instance chosen held (prefix_aware)"),
    "session_placements": ("pdserve_router_session_placements", "requests placed on the instances their session's "
                                                                "last request ran on (x-session-id, user)"),
    "kv_fetches_chosen": ("pdserve_router_kv_fetches_chosen", "placements that fetch a prompt prefix another prefill "
                                                              "instance holds (its measures say it pays, or unmeasured)"),
    "kv_fetches_declined": ("pdserve_router_kv_fetches_declined", "placements that compute a prefix another prefill "
                                                                  "instance holds: its measures say computing is faster"),
    "kv_fetches_opened": ("pdserve_router_kv_fetches_opened", "fetches the prefill instance opened and the holder "
                                                              "was told to ship"),
    "kv_fetches_not_opened": ("pdserve_router_kv_fetches_not_opened", "fetches the prefill instance did not open "
                                                                      "(no room, no gain): computed"),
    "kv_fetches_refused": ("pdserve_router_kv_fetches_refused", "fetches the holder refused or could not be told "
                                                                "of (its prefix evicted, it died): computed"),
}


class GatewayMetrics:
    def __init__(self, cluster):
        self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "finished HTTP generation requests", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "time to first token", buckets=_LATENCY,
                              registry=self.registry)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between output token batches",
                             buckets=_LATENCY, registry=self.registry)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=_LATENCY, registry=self.registry)
        # a request's phases (gateway/trace.py; router/tables.py PHASES), the trace id as exemplar where traced
        self.phases = Histogram("pdserve_request_phase_seconds", "seconds a finished request spent in each phase: "
                                "gateway prepare, router queue, prefill queue and compute, decode's wait for the KV, "
                                "decode", ["phase"], buckets=_LATENCY, registry=self.registry)
        for phase in REQUEST_PHASES:
            self.phases.labels(phase)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens", registry=self.registry)
        self.deadline_exceeded = Counter("pdserve_request_deadline_exceeded", "generation requests ended by their "
                                         "deadline (request_timeout_s): 504, or an error chunk on a stream",
                                         ["endpoint"], registry=self.registry)
        for endpoint in ("chat", "completion"):
            self.deadline_exceeded.labels(endpoint)
        # per API key name (gateway/guard.py): names come from the operator's keys file, plus NO_KEY
        self.api_key_requests = Counter("pdserve_api_key_requests", "API requests by key name and outcome "
                                        "(API_KEY_OUTCOMES)", ["key", "outcome"], registry=self.registry)
        self.api_key_in_flight = Gauge("pdserve_api_key_in_flight_requests", "API requests in flight by key name "
                                       "(admitted, response not yet ended)", ["key"], registry=self.registry)
        self._tenant_metrics()
        self.cluster = cluster
        self.registry.register(self)
        if getattr(cluster, "autoscaler", None) is not None:  # its decisions, desired and current sizes
            self.registry.register(cluster.autoscaler)

    def _tenant_metrics(self) -> None:
        """By priority class and API key (issue 54): outcomes, queue time, preemptions; and where the
        keys' limits are held (gateway/limits.py)."""
        labels = ["priority", "key"]
        self.tenant_requests = Counter("pdserve_tenant_requests", "generation requests by priority class, API key "
                                       "and outcome (TENANT_OUTCOMES)", [*labels, "outcome"], registry=self.registry)
        self.tenant_queue = Histogram("pdserve_tenant_queue_seconds", "seconds finished requests waited in the "
                                      "router's queue, by priority class and API key", labels, buckets=_LATENCY,
                                      registry=self.registry)
        self.tenant_preemptions = Counter("pdserve_tenant_preemptions", "preemptions (recomputes) of finished "
                                          "requests on decode instances, by priority class and API key", labels,
                                          registry=self.registry)
        self.limits_shared = Gauge("pdserve_api_key_limits_shared", "1: the API keys' limits are held in Redis for "
                                   "every gateway; 0: by this gateway alone (no Redis, or it did not answer)",
                                   registry=self.registry)
        self.limits_local = Counter("pdserve_api_key_limits_local_decisions", "limit decisions this gateway took "
                                    "alone because Redis did not answer", registry=self.registry)

    def tenant(self, priority: int, key: str, outcome: str) -> None:
        self.tenant_requests.labels(class_label(priority), key, outcome).inc()

    def tenant_ended(self, priority: int, key: str, queue_s: float | None, preemptions: int, timed_out: bool) -> None:
        cls = class_label(priority)
        if queue_s is not None:
            self.tenant_queue.labels(cls, key).observe(queue_s)
        if preemptions:
            self.tenant_preemptions.labels(cls, key).inc(preemptions)
        if timed_out:
            self.tenant(priority, key, "queue_timeout")

    def limits_mode(self, shared: bool, configured: bool) -> None:
        """Where a limit decision was taken (gateway/limits.py KeyLimits.on_mode)."""
        self.limits_shared.set(1.0 if shared else 0.0)
        if configured and not shared:
            self.limits_local.inc()

    def add_api_keys(self, names: list[str]) -> None:
        """Creates each key's series at 0, so a dashboard shows a key before its first request
        ("unauthorized" only ever counts under NO_KEY: a wrong key has no name)."""
        for name in names:
            self.api_key_in_flight.labels(name)
            for outcome in API_KEY_OUTCOMES:
                if outcome != "unauthorized":
                    self.api_key_requests.labels(name, outcome)

    def collect(self):
        """Scrape-time gauges from the router's view (refreshed every 0.1 s)."""
        router = self.cluster.router
        queue = GaugeMetricFamily("pdserve_router_queue_depth", "requests waiting for a decode instance")
        queue.add_metric([], float(router.num_queued) if router else 0.0)
        active = GaugeMetricFamily("pdserve_router_active_requests", "requests placed on instances")
        active.add_metric([], float(router.num_placed) if router else 0.0)
        healthy = GaugeMetricFamily("pdserve_instance_healthy", "1 if the instance is serving", labels=["instance_id", "role"])
        families = {k: GaugeMetricFamily(name, doc, labels=["instance_id", "role"])
                    for k, (name, doc) in INSTANCE_GAUGES.items()}
        by_layer = {prefix: GaugeMetricFamily(name, doc, labels=["instance_id", "role", "layer"])
                    for prefix, (name, doc) in LAYER_GAUGES.items()}
        spec = {key: kind(name, doc, labels=["instance_id", "role", "method", "position"])
                for key, (name, doc, kind) in SPEC_FIGURES.items()}
        for info in self.cluster.instance_infos():
            healthy.add_metric([info.instance_id, info.role], 1.0 if info.healthy else 0.0)
            figures = info.load.figures
            for key, fam in families.items():
                if key in figures:
                    fam.add_metric([info.instance_id, info.role], figures[key])
            for key, value in figures.items():
                prefix, _, layer = key.rpartition("/")
                if prefix + "/" in by_layer:
                    by_layer[prefix + "/"].add_metric([info.instance_id, info.role, layer], value)
                figure, _, method_position = key.partition("/")
                if figure in spec:  # "spec_proposed/<method>/<position>"
                    spec[figure].add_metric([info.instance_id, info.role, *method_position.split("/")], value)
        counters = []
        for key, (name, doc) in ROUTER_COUNTERS.items():
            counters.append(CounterMetricFamily(name, doc, value=router.stats[key] if router else 0))
        yield from [queue, active, healthy, *families.values(), *by_layer.values(), *spec.values(), *counters,
                    *_router_guard_counters(router)]

    def describe(self):
        return []


def class_label(priority: int) -> str:
    """A priority class as a metric label: its value, within +-MAX_CLASS_LABEL."""
    if priority > MAX_CLASS_LABEL:
        return f">{MAX_CLASS_LABEL}"
    return f"<-{MAX_CLASS_LABEL}" if priority < -MAX_CLASS_LABEL else str(priority)


def _router_guard_counters(router) -> list[CounterMetricFamily]:
    """What the router's guards caught (each failed one request) and its threads' restarts
    (router/supervisor.py), by handler and by thread kind; none from a router without them."""
    errors = CounterMetricFamily("pdserve_router_handler_errors", "exceptions a router handler raised; each "
                                 "failed only the request it was handling", labels=["handler"])
    for handler, n in getattr(router, "handler_errors", {}).items():
        errors.add_metric([handler], n)
    restarts = CounterMetricFamily("pdserve_router_thread_restarts", "router threads restarted after an "
                                   "exception escaped their loop", labels=["thread"])
    for thread, n in getattr(router, "thread_restarts", {}).items():
        restarts.add_metric([thread], n)
    return [errors, restarts]
