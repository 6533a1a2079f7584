"""The cluster state in Redis (`RedisState`), shared by every process of the cluster: the
controller, every gateway, `pdserve status`. Interface and semantics: cluster/state.py. The client
(credentials, TLS, masked URL): cluster/redis_client.py."""
from __future__ import annotations

import logging
import os
import time

import msgpack

from cluster.redis_client import connect
from cluster.state import ClusterState, InstanceRecord, _check_health, _found


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
_LOAD_PREFIX = "load:"
logger = logging.getLogger(__name__)


class RedisState(ClusterState):
    """State in Redis, shared by every process of the cluster.

    Keys (all under `namespace`):
        {ns}:instances          set of instance ids
        {ns}:inst:{id}          hash: role, tp_size, kv_endpoints, health, updated_at,
                                heartbeat (armed flag), load:{name}; each value msgpack
        {ns}:hb:{id}            heartbeat key with PX expiry
        {ns}:metric:{name}      sorted set scored by timestamp; members msgpack [ts, value, nonce]
        {ns}:router:{id}        a router's counters (msgpack map) with PX expiry

    Args:
        url: e.g. "redis://127.0.0.1:6379/0"; user, password and TLS CA may come from the
            PDSERVE_REDIS_* variables (cluster/redis_client.py). Checked here with one PING:
            ValueError (RedisAuthError) as one line if refused or unreachable.
        namespace: key prefix, so several clusters can share one Redis.
        metric_retention_s: samples older than this are trimmed when new ones arrive.
    """

    def __init__(self, url: str, namespace: str = "pdserve", metric_retention_s: float = 3600.0):
        self.url = url
        self.namespace = namespace
        self.metric_retention_s = metric_retention_s
        self._redis = connect(url, decode_responses=False)
        self._hset_if_exists = self._redis.register_script(_HSET_IF_EXISTS)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self.malformed_records = 0  # records skipped as unreadable (_decode)
        self._malformed_ids: set[str] = set()

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def _decode(self, instance_id: str, fields: dict[bytes, bytes]) -> InstanceRecord | None:
        """The record, or None when there is none or it cannot be read: one malformed record (a
        stranger's write, an older version's) is skipped, logged once and counted, so every
        reader's view of the others goes on."""
        if not fields:
            return None
        try:
            return self._record(instance_id, fields)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:  # msgpack's errors are ValueErrors
            self.malformed_records += 1
            if instance_id not in self._malformed_ids:
                self._malformed_ids.add(instance_id)
                logger.warning("cluster state: the record of %r is malformed (%s: %s); skipped",
                               instance_id, type(exc).__name__, str(exc)[:200])
            return None

    def _record(self, instance_id: str, fields: dict[bytes, bytes]) -> InstanceRecord:
        values = {k.decode(): _unpack(v) for k, v in fields.items()}
        load = {k[len(_LOAD_PREFIX):]: v for k, v in values.items() if k.startswith(_LOAD_PREFIX)}
        return InstanceRecord(instance_id=instance_id, role=values["role"], tp_size=values["tp_size"],
                              kv_endpoints=[tuple(e) for e in values["kv_endpoints"]], health=values["health"],
                              load=load, updated_at=values["updated_at"],
                              max_model_len=values.get("max_model_len", 0), block_size=values.get("block_size", 0),
                              ranks=[tuple(r) for r in values.get("ranks", [])], engine=values.get("engine", {}),
                              rank_cpus=values.get("rank_cpus", []))

    def register(self, record: InstanceRecord) -> None:
        i = record.instance_id
        fields = {"role": record.role, "tp_size": record.tp_size,
                  "kv_endpoints": [list(e) for e in record.kv_endpoints], "health": record.health,
                  "updated_at": time.time(), "max_model_len": record.max_model_len, "block_size": record.block_size,
                  "ranks": [list(r) for r in record.ranks], "engine": dict(record.engine),
                  "rank_cpus": [dict(c) for c in record.rank_cpus],
                  **{_LOAD_PREFIX + k: float(v) for k, v in record.load.items()}}
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("inst", i), self._key("hb", i))
            pipe.hset(self._key("inst", i), mapping={k: _pack(v) for k, v in fields.items()})
            pipe.sadd(self._key("instances"), i)
            pipe.incr(self._key("version"))
            pipe.execute()

    def _hset(self, instance_id: str, fields: dict) -> None:
        _found(self._hset_if_exists(keys=[self._key("inst", instance_id)], args=_hset_args(fields)), instance_id)

    def update_load(self, instance_id: str, load: dict[str, float]) -> None:
        self._hset(instance_id, _load_fields(load, time.time()))

    def set_health(self, instance_id: str, health: str) -> None:
        _check_health(health)
        self._hset(instance_id, {"health": health, "updated_at": time.time()})
        self._redis.incr(self._key("version"))  # (after the change: a reader that sees it sees the change)

    def version(self) -> int:
        return int(self._redis.get(self._key("version")) or 0)

    def report(self, loads: dict[str, dict[str, float]], ttl_s: float) -> list[str]:
        """In one round trip (the scripts of `heartbeat` and `update_load`, pipelined)."""
        ids, now = list(loads), time.time()
        beat = _heartbeat_args(ttl_s, now)
        with self._redis.pipeline(transaction=False) as pipe:
            for i in ids:
                keys = [self._key("inst", i), self._key("hb", i)]
                self._heartbeat(keys=keys, args=beat, client=pipe)
                self._hset_if_exists(keys=keys[:1], args=_hset_args(_load_fields(loads[i], now)), client=pipe)
            replies = pipe.execute()
        return [i for i, ok in zip(ids, replies[0::2]) if not ok]

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
            pipe.delete(self._key("inst", instance_id), self._key("hb", instance_id))
            pipe.srem(self._key("instances"), instance_id)
            pipe.incr(self._key("version"))
            pipe.execute()

    def heartbeat(self, instance_id: str, ttl_s: float) -> None:
        ok = self._heartbeat(keys=[self._key("inst", instance_id), self._key("hb", instance_id)],
                             args=_heartbeat_args(ttl_s, time.time()))
        _found(ok, instance_id)

    def expired_instances(self) -> list[str]:
        return [r.instance_id for r, expired in self._fetch(self._ids()) if expired]

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

    def publish_router(self, router_id: str, stats: dict[str, float], ttl_s: float) -> None:
        value = _pack({str(k): float(v) for k, v in stats.items()})
        self._redis.set(self._key("router", router_id), value, px=max(1, round(ttl_s * 1000)))

    def router_stats(self) -> dict[str, dict[str, float]]:
        keys = list(self._redis.scan_iter(match=self._key("router", "*"), count=1000))
        values = self._redis.mget(keys) if keys else []
        prefix = len(self._key("router", ""))
        return {k.decode()[prefix:]: _unpack(v) for k, v in zip(keys, values) if v is not None}

    def close(self) -> None:
        self._redis.close()


def _hset_args(fields: dict) -> list:
    """The _HSET_IF_EXISTS script's arguments: field, packed value, ..."""
    return [x for k, v in fields.items() for x in (k, _pack(v))]


def _load_fields(load: dict[str, float], now: float) -> dict:
    """A record's fields for load figures written at `now`."""
    return {**{_LOAD_PREFIX + str(k): float(v) for k, v in load.items()}, "updated_at": now}


def _heartbeat_args(ttl_s: float, now: float) -> list:
    """The _HEARTBEAT script's arguments (its TTL in ms); ValueError for a TTL that is not > 0."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return [max(1, round(ttl_s * 1000)), _pack(True), _pack(now)]
