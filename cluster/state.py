"""Cluster state: instance records, heartbeats, routers' counters and autoscaler metrics.

What each instance's prefix cache holds is not here: a router follows the engines' KV events
(router/prefix_index.py).

One interface (`ClusterState`), two backends: `MemoryState` (default, in-process, thread-safe)
and `RedisState` (cluster/redis_state.py: shared by every process of the cluster; values are
msgpack); `create_state` (cluster/state_factory.py) picks one by URL. A leaf module: any layer
may import it, and it imports nothing of ours.

Times: `updated_at` and metric timestamps are wall-clock (`time.time()`), because they are
compared across processes and machines. Heartbeat deadlines are relative (a TTL), so the memory
backend tracks them with `time.monotonic()` and Redis with key expiry.
"""
from __future__ import annotations

import bisect
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace


ROLES = ("prefill", "decode", "colocated")
HEALTH_STATES = ("healthy", "draining", "dead")


@dataclass
class InstanceRecord:
    """What the cluster knows about one instance (a group of TP ranks).

    Attributes:
        instance_id: unique name of the instance.
        role: "prefill", "decode" or "colocated".
        tp_size: number of tensor-parallel ranks.
        kv_endpoints: (host, port) of each rank's KV receiver, rank order (a prefill's: for the KV it
            fetches); empty for colocated.
        health: "healthy", "draining" (no new requests) or "dead".
        load: load figures, e.g. queued_prefill_tokens, running, waiting, kv_usage.
        updated_at: wall-clock time of the last write, stamped by the state backend.
        max_model_len: the longest prompt + output the instance holds (0: unknown).
        block_size: tokens per KV block its engine uses (0: unknown).
        ranks: (node address, process id) of each rank, rank order; a gateway shows them.
        engine: what the engine chose at load (dtype, linear_layers, attention, kv_cache_dtype),
            shown in /status ({}: unknown, e.g. written by an older controller).
        rank_cpus: how each rank shares its host's CPUs (niceness, cores, threads; cluster/ranks/cpu_plan.py),
            rank order, shown in /status ([]: unknown).
    """

    instance_id: str
    role: str
    tp_size: int = 1
    kv_endpoints: list[tuple[str, int]] = field(default_factory=list)
    health: str = "healthy"
    load: dict[str, float] = field(default_factory=dict)
    updated_at: float = 0.0
    max_model_len: int = 0
    ranks: list[tuple[str, int]] = field(default_factory=list)
    block_size: int = 0
    engine: dict[str, str] = field(default_factory=dict)
    rank_cpus: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.instance_id:
            raise ValueError("instance_id must be a non-empty string")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {ROLES}")
        _check_health(self.health)
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        self.kv_endpoints = [(str(host), int(port)) for host, port in self.kv_endpoints]
        self.load = {str(k): float(v) for k, v in self.load.items()}
        self.ranks = [(str(host), int(pid)) for host, pid in self.ranks]
        self.engine = {str(k): str(v) for k, v in self.engine.items()}
        self.rank_cpus = [dict(c) for c in self.rank_cpus]
        if self.kv_endpoints and len(self.kv_endpoints) != self.tp_size:
            raise ValueError(f"{len(self.kv_endpoints)} kv_endpoints for tp_size {self.tp_size}: "
                             "give one per rank (or none)")

    def copy(self) -> InstanceRecord:
        return replace(self, kv_endpoints=list(self.kv_endpoints), load=dict(self.load), ranks=list(self.ranks),
                       engine=dict(self.engine), rank_cpus=[dict(c) for c in self.rank_cpus])


def _check_health(health: str) -> None:
    if health not in HEALTH_STATES:
        raise ValueError(f"unknown health {health!r}; choose one of {HEALTH_STATES}")


def _found(ok: int, instance_id: str) -> None:
    if not ok:
        raise KeyError(f"unknown instance {instance_id!r}")


class ClusterState(ABC):
    """Shared view of the cluster. Every method is safe to call from several threads.

    Routers also publish their request counters here (`publish_router`), for the autoscaler.

    Mutations of an unknown instance (`update_load`, `set_health`, `heartbeat`) raise KeyError;
    `remove` of an unknown instance is a no-op.
    """

    @abstractmethod
    def register(self, record: InstanceRecord) -> None:
        """Adds an instance, replacing any previous record with the same id together with
        its heartbeat.

        Args:
            record: the instance; its `updated_at` is stamped with the current time.
        """

    @abstractmethod
    def update_load(self, instance_id: str, load: dict[str, float]) -> None:
        """Merges load figures into the record: the given keys are overwritten, others kept.

        Args:
            instance_id: a registered instance.
            load: figure name -> value, e.g. {"running": 3, "kv_usage": 0.41}.
        """

    @abstractmethod
    def set_health(self, instance_id: str, health: str) -> None:
        """Sets the health of a registered instance: "healthy", "draining" or "dead"."""

    @abstractmethod
    def get(self, instance_id: str) -> InstanceRecord | None:
        """Returns a copy of the record, or None if the instance is not registered."""

    @abstractmethod
    def list_instances(self, role: str | None = None, healthy_only: bool = False) -> list[InstanceRecord]:
        """Args:
            role: only instances of this role; None = all.
            healthy_only: only instances that are "healthy" and whose heartbeat has not expired.
        Returns:
            Copies of the records, sorted by instance_id.
        """

    @abstractmethod
    def remove(self, instance_id: str) -> None:
        """Forgets the instance: its record and heartbeat."""

    @abstractmethod
    def version(self) -> int:
        """A number that changes whenever an instance is registered, removed or changes health (not
        with loads or heartbeats): a reader of the membership re-reads the records when it moved."""

    def report(self, loads: dict[str, dict[str, float]], ttl_s: float) -> list[str]:
        """The controller's probe: `heartbeat` and `update_load` of every instance of `loads` (id ->
        figures). Returns the ids the state does not have (a restarted Redis lost them), in order."""
        missing = []
        for instance_id, load in loads.items():
            try:
                self.heartbeat(instance_id, ttl_s)
                self.update_load(instance_id, load)
            except KeyError:
                missing.append(instance_id)
        return missing

    @abstractmethod
    def heartbeat(self, instance_id: str, ttl_s: float) -> None:
        """Marks the instance alive for the next `ttl_s` seconds. An instance that has never
        sent a heartbeat is not subject to expiry; after its first one it expires unless it
        sends the next within the TTL.

        Args:
            instance_id: a registered instance.
            ttl_s: seconds until the heartbeat expires (> 0).
        """

    @abstractmethod
    def expired_instances(self) -> list[str]:
        """Returns the sorted ids of registered instances whose last heartbeat has expired."""

    @abstractmethod
    def record_metric(self, name: str, value: float, ts: float | None = None) -> None:
        """Appends one sample; samples older than the backend's retention are trimmed.

        Args:
            name: metric name, e.g. "ttft_s" or "arrivals".
            value: the sample.
            ts: wall-clock time of the sample; None = now.
        """

    @abstractmethod
    def recent_metrics(self, name: str, window_s: float) -> list[tuple[float, float]]:
        """Returns the (ts, value) samples with ts >= now - window_s, oldest first."""

    @abstractmethod
    def publish_router(self, router_id: str, stats: dict[str, float], ttl_s: float) -> None:
        """A router's (gateway's) cumulative request counters, kept for `ttl_s` seconds unless
        published again (the controller's autoscaler sums them over the live routers)."""

    @abstractmethod
    def router_stats(self) -> dict[str, dict[str, float]]:
        """router id -> its last published counters, for every router published within its TTL."""

    def close(self) -> None:
        """Releases connections; the state must not be used afterwards."""


class MemoryState(ClusterState):
    """In-process state behind one lock. The default for a single-process cluster and tests.

    Args:
        metric_retention_s: samples older than this are dropped when new ones arrive.
    """

    def __init__(self, metric_retention_s: float = 3600.0):
        self.metric_retention_s = metric_retention_s
        self._lock = threading.Lock()
        self._records: dict[str, InstanceRecord] = {}
        self._deadlines: dict[str, float] = {}  # instance_id -> time.monotonic() deadline
        self._metrics: dict[str, list[tuple[float, float]]] = {}  # sorted by ts
        self._routers: dict[str, tuple[float, dict[str, float]]] = {}  # id -> (monotonic deadline, stats)
        self._version = 0

    def _record(self, instance_id: str) -> InstanceRecord:
        record = self._records.get(instance_id)
        _found(record is not None, instance_id)
        return record

    def register(self, record: InstanceRecord) -> None:
        record = record.copy()
        record.updated_at = time.time()
        with self._lock:
            self._records[record.instance_id] = record
            self._deadlines.pop(record.instance_id, None)
            self._version += 1

    def update_load(self, instance_id: str, load: dict[str, float]) -> None:
        with self._lock:
            record = self._record(instance_id)
            record.load.update({str(k): float(v) for k, v in load.items()})
            record.updated_at = time.time()

    def set_health(self, instance_id: str, health: str) -> None:
        _check_health(health)
        with self._lock:
            record = self._record(instance_id)
            record.health = health
            record.updated_at = time.time()
            self._version += 1

    def get(self, instance_id: str) -> InstanceRecord | None:
        with self._lock:
            record = self._records.get(instance_id)
            return None if record is None else record.copy()

    def list_instances(self, role: str | None = None, healthy_only: bool = False) -> list[InstanceRecord]:
        with self._lock:
            now = time.monotonic()
            out = [r.copy() for r in self._records.values()
                   if (role is None or r.role == role)
                   and not (healthy_only and (r.health != "healthy" or self._expired(r.instance_id, now)))]
        return sorted(out, key=lambda r: r.instance_id)

    def remove(self, instance_id: str) -> None:
        with self._lock:
            self._records.pop(instance_id, None)
            self._deadlines.pop(instance_id, None)
            self._version += 1

    def version(self) -> int:
        with self._lock:
            return self._version

    def _expired(self, instance_id: str, now: float) -> bool:
        deadline = self._deadlines.get(instance_id)
        return deadline is not None and now >= deadline

    def heartbeat(self, instance_id: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            record = self._record(instance_id)
            self._deadlines[instance_id] = time.monotonic() + ttl_s
            record.updated_at = time.time()

    def expired_instances(self) -> list[str]:
        with self._lock:
            now = time.monotonic()
            return sorted(i for i in self._records if self._expired(i, now))

    def record_metric(self, name: str, value: float, ts: float | None = None) -> None:
        ts = time.time() if ts is None else float(ts)
        with self._lock:
            samples = self._metrics.setdefault(name, [])
            bisect.insort(samples, (ts, float(value)))
            del samples[:bisect.bisect_left(samples, (time.time() - self.metric_retention_s,))]

    def recent_metrics(self, name: str, window_s: float) -> list[tuple[float, float]]:
        horizon = time.time() - window_s
        with self._lock:
            samples = self._metrics.get(name, [])
            return samples[bisect.bisect_left(samples, (horizon,)):]


    def publish_router(self, router_id: str, stats: dict[str, float], ttl_s: float) -> None:
        with self._lock:
            self._routers[router_id] = (time.monotonic() + ttl_s, {str(k): float(v) for k, v in stats.items()})

    def router_stats(self) -> dict[str, dict[str, float]]:
        with self._lock:
            now = time.monotonic()
            self._routers = {k: v for k, v in self._routers.items() if v[0] > now}
            return {k: dict(stats) for k, (_, stats) in self._routers.items()}
