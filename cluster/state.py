"""Cluster state: instance records, heartbeats, the prefix-hash index and autoscaler metrics.

One interface (`ClusterState`), two backends: `MemoryState` (default, in-process, thread-safe)
and `RedisState` (shared by every process of the cluster; values are msgpack). A leaf module:
any layer may import it, and it imports nothing of ours.

Times: `updated_at` and metric timestamps are wall-clock (`time.time()`), because they are
compared across processes and machines. Heartbeat deadlines are relative (a TTL), so the memory
backend tracks them with `time.monotonic()` and Redis with key expiry.
"""
from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import msgpack

ROLES = ("prefill", "decode", "colocated")
HEALTH_STATES = ("healthy", "draining", "dead")
MAX_HASH = 2**64 - 1


@dataclass
class InstanceRecord:
    """What the cluster knows about one instance (a group of TP ranks).

    Attributes:
        instance_id: unique name of the instance.
        role: "prefill", "decode" or "colocated".
        tp_size: number of tensor-parallel ranks.
        kv_endpoints: (host, port) of each rank's KV receiver, rank order; empty for prefill.
        health: "healthy", "draining" (no new requests) or "dead".
        load: load figures, e.g. queued_prefill_tokens, running, waiting, kv_usage.
        updated_at: wall-clock time of the last write, stamped by the state backend.
    """

    instance_id: str
    role: str
    tp_size: int = 1
    kv_endpoints: list[tuple[str, int]] = field(default_factory=list)
    health: str = "healthy"
    load: dict[str, float] = field(default_factory=dict)
    updated_at: float = 0.0

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
        if self.kv_endpoints and len(self.kv_endpoints) != self.tp_size:
            raise ValueError(f"{len(self.kv_endpoints)} kv_endpoints for tp_size {self.tp_size}: "
                             "give one per rank (or none)")

    def copy(self) -> InstanceRecord:
        return replace(self, kv_endpoints=list(self.kv_endpoints), load=dict(self.load))


def _check_health(health: str) -> None:
    if health not in HEALTH_STATES:
        raise ValueError(f"unknown health {health!r}; choose one of {HEALTH_STATES}")


def _found(ok: int, instance_id: str) -> None:
    if not ok:
        raise KeyError(f"unknown instance {instance_id!r}")


def _check_hashes(hashes: list[int]) -> list[int]:
    out = [int(h) for h in hashes]
    for h in out:
        if not 0 <= h <= MAX_HASH:
            raise ValueError(f"block hash {h} is not an unsigned 64-bit int")
    return out


def _leading_run(held: list[bool]) -> int:
    """Number of leading True values."""
    return sum(1 for _ in itertools.takewhile(bool, held))


class ClusterState(ABC):
    """Shared view of the cluster. Every method is safe to call from several threads.

    Mutations of an unknown instance (`update_load`, `set_health`, `heartbeat`,
    `add_block_hashes`) raise KeyError; `remove`, `remove_block_hashes` and
    `drop_instance_hashes` of an unknown instance are no-ops.
    """

    @abstractmethod
    def register(self, record: InstanceRecord) -> None:
        """Adds an instance, replacing any previous record with the same id together with
        its heartbeat and block hashes (a restarted instance starts with an empty cache).

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
        """Forgets the instance: its record, heartbeat and block hashes."""

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
    def add_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        """Records that the instance holds these cached blocks.

        Args:
            instance_id: a registered instance.
            hashes: chained block hashes, unsigned 64-bit ints.
        """

    @abstractmethod
    def remove_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        """Records that the instance evicted these blocks; unknown hashes are ignored."""

    @abstractmethod
    def longest_prefix(self, hashes: list[int], role: str | None = None) -> dict[str, int]:
        """How much of a prompt each instance already caches.

        Args:
            hashes: the prompt's chained block hashes, in order.
            role: only instances of this role; None = all.
        Returns:
            instance_id -> number of LEADING hashes of `hashes` the instance holds
            (0 included); a hash held after a miss does not count.
        """

    @abstractmethod
    def drop_instance_hashes(self, instance_id: str) -> None:
        """Forgets every block hash of the instance (e.g. after it reset its cache)."""

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
        self._hashes: dict[str, set[int]] = {}
        self._metrics: dict[str, list[tuple[float, float]]] = {}  # sorted by ts

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
            self._hashes[record.instance_id] = set()

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
            self._hashes.pop(instance_id, None)

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

    def add_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        hashes = _check_hashes(hashes)
        with self._lock:
            self._record(instance_id)
            self._hashes[instance_id].update(hashes)

    def remove_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        hashes = _check_hashes(hashes)
        with self._lock:
            self._hashes.get(instance_id, set()).difference_update(hashes)

    def longest_prefix(self, hashes: list[int], role: str | None = None) -> dict[str, int]:
        hashes = _check_hashes(hashes)
        with self._lock:
            return {i: _leading_run([h in self._hashes[i] for h in hashes])
                    for i, r in self._records.items() if role is None or r.role == role}

    def drop_instance_hashes(self, instance_id: str) -> None:
        with self._lock:
            if instance_id in self._hashes:
                self._hashes[instance_id] = set()

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


def _pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


# Lua scripts make "check the instance exists, then write" atomic against a concurrent remove().
_HSET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
redis.call('HSET', KEYS[1], 'heartbeat', ARGV[2], 'updated_at', ARGV[3])
return 1
"""
_SADD_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #ARGV, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return 1
"""
_LOAD_PREFIX = "load:"


class RedisState(ClusterState):
    """State in Redis, shared by every process of the cluster.

    Keys (all under `namespace`):
        {ns}:instances          set of instance ids
        {ns}:inst:{id}          hash: role, tp_size, kv_endpoints, health, updated_at,
                                heartbeat (armed flag), load:{name}; each value msgpack
        {ns}:hb:{id}            heartbeat key with PX expiry
        {ns}:hashes:{id}        set of msgpack-encoded block hashes
        {ns}:metric:{name}      sorted set scored by timestamp; members msgpack [ts, value, nonce]

    Args:
        url: e.g. "redis://127.0.0.1:6379/0".
        namespace: key prefix, so several clusters can share one Redis.
        metric_retention_s: samples older than this are trimmed when new ones arrive.
    """

    def __init__(self, url: str, namespace: str = "pdserve", metric_retention_s: float = 3600.0):
        import redis  # only the Redis backend needs the client

        self.url = url
        self.namespace = namespace
        self.metric_retention_s = metric_retention_s
        self._redis = redis.Redis.from_url(url, decode_responses=False)
        self._hset_if_exists = self._redis.register_script(_HSET_IF_EXISTS)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._sadd_if_exists = self._redis.register_script(_SADD_IF_EXISTS)

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def _decode(self, instance_id: str, fields: dict[bytes, bytes]) -> InstanceRecord | None:
        if not fields:
            return None
        values = {k.decode(): _unpack(v) for k, v in fields.items()}
        load = {k[len(_LOAD_PREFIX):]: v for k, v in values.items() if k.startswith(_LOAD_PREFIX)}
        return InstanceRecord(instance_id=instance_id, role=values["role"], tp_size=values["tp_size"],
                              kv_endpoints=[tuple(e) for e in values["kv_endpoints"]], health=values["health"],
                              load=load, updated_at=values["updated_at"])

    def register(self, record: InstanceRecord) -> None:
        i = record.instance_id
        fields = {"role": record.role, "tp_size": record.tp_size,
                  "kv_endpoints": [list(e) for e in record.kv_endpoints], "health": record.health,
                  "updated_at": time.time(), **{_LOAD_PREFIX + k: float(v) for k, v in record.load.items()}}
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("inst", i), self._key("hb", i), self._key("hashes", i))
            pipe.hset(self._key("inst", i), mapping={k: _pack(v) for k, v in fields.items()})
            pipe.sadd(self._key("instances"), i)
            pipe.execute()

    def _hset(self, instance_id: str, fields: dict) -> None:
        args = [x for k, v in fields.items() for x in (k, _pack(v))]
        _found(self._hset_if_exists(keys=[self._key("inst", instance_id)], args=args), instance_id)

    def update_load(self, instance_id: str, load: dict[str, float]) -> None:
        self._hset(instance_id, {**{_LOAD_PREFIX + str(k): float(v) for k, v in load.items()},
                                 "updated_at": time.time()})

    def set_health(self, instance_id: str, health: str) -> None:
        _check_health(health)
        self._hset(instance_id, {"health": health, "updated_at": time.time()})

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._decode(instance_id, self._redis.hgetall(self._key("inst", instance_id)))

    def _ids(self) -> list[str]:
        return sorted(i.decode() for i in self._redis.smembers(self._key("instances")))

    def _fetch(self, ids: list[str]) -> list[tuple[InstanceRecord, bool]]:
        """(record, expired) of each id still registered, in one round trip."""
        with self._redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self._key("inst", i))
                pipe.exists(self._key("hb", i))
            replies = pipe.execute()
        out = []
        for i, fields, alive in zip(ids, replies[0::2], replies[1::2]):
            record = self._decode(i, fields)
            if record is not None:
                out.append((record, b"heartbeat" in fields and not alive))
        return out

    def list_instances(self, role: str | None = None, healthy_only: bool = False) -> list[InstanceRecord]:
        return [r for r, expired in self._fetch(self._ids())
                if (role is None or r.role == role) and not (healthy_only and (r.health != "healthy" or expired))]

    def remove(self, instance_id: str) -> None:
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("inst", instance_id), self._key("hb", instance_id),
                        self._key("hashes", instance_id))
            pipe.srem(self._key("instances"), instance_id)
            pipe.execute()

    def heartbeat(self, instance_id: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        ok = self._heartbeat(keys=[self._key("inst", instance_id), self._key("hb", instance_id)],
                             args=[max(1, round(ttl_s * 1000)), _pack(True), _pack(time.time())])
        _found(ok, instance_id)

    def expired_instances(self) -> list[str]:
        return [r.instance_id for r, expired in self._fetch(self._ids()) if expired]

    def add_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        members = [_pack(h) for h in _check_hashes(hashes)]
        keys = [self._key("inst", instance_id), self._key("hashes", instance_id)]
        _found(self._sadd_if_exists(keys=keys, args=members), instance_id)

    def remove_block_hashes(self, instance_id: str, hashes: list[int]) -> None:
        members = [_pack(h) for h in _check_hashes(hashes)]
        if members:
            self._redis.srem(self._key("hashes", instance_id), *members)

    def longest_prefix(self, hashes: list[int], role: str | None = None) -> dict[str, int]:
        members = [_pack(h) for h in _check_hashes(hashes)]
        if not members:
            return {r.instance_id: 0 for r in self.list_instances(role)}
        ids = self._ids()
        with self._redis.pipeline(transaction=False) as pipe:
            for i in ids:  # one round trip: each instance's role and membership of every hash
                pipe.hget(self._key("inst", i), "role")
                pipe.smismember(self._key("hashes", i), members)
            replies = pipe.execute()
        return {i: _leading_run(held) for i, raw_role, held in zip(ids, replies[0::2], replies[1::2])
                if raw_role is not None and (role is None or _unpack(raw_role) == role)}

    def drop_instance_hashes(self, instance_id: str) -> None:
        self._redis.delete(self._key("hashes", instance_id))

    def record_metric(self, name: str, value: float, ts: float | None = None) -> None:
        ts = time.time() if ts is None else float(ts)
        member = _pack([ts, float(value), os.urandom(8)])  # the nonce keeps equal samples distinct
        key = self._key("metric", name)
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {member: ts})
            pipe.zremrangebyscore(key, "-inf", f"({time.time() - self.metric_retention_s!r}")
            pipe.execute()

    def recent_metrics(self, name: str, window_s: float) -> list[tuple[float, float]]:
        members = self._redis.zrangebyscore(self._key("metric", name), repr(time.time() - window_s), "+inf")
        return [(ts, value) for ts, value, _ in map(_unpack, members)]

    def close(self) -> None:
        self._redis.close()


def create_state(url: str | None = None) -> ClusterState:
    """Returns `MemoryState` for None or "memory://", `RedisState` for "redis://...",
    "rediss://..." or "unix://..."; raises ValueError for anything else."""
    if url is None or url == "memory://":
        return MemoryState()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisState(url)
    raise ValueError(f"unsupported cluster state url {url!r}: use memory:// or redis://host:port/db")
