"""ClusterState contract: every test runs against MemoryState and RedisState alike."""
from __future__ import annotations

import threading
import time

import pytest

from cluster.redis_state import RedisState
from cluster.state import ClusterState, InstanceRecord, MemoryState
from cluster.state_factory import create_state



@pytest.fixture(params=["memory", "redis"])
def make_state(request):
    """Factory of fresh states of one backend; Redis starts from an empty database."""
    made: list[ClusterState] = []

    def make(**kw) -> ClusterState:
        if request.param == "memory":
            state = MemoryState(**kw)
        else:
            state = RedisState(request.getfixturevalue("redis_url"), **kw)
            if not made:
                state._redis.flushdb()
        made.append(state)
        return state

    yield make
    for state in made:
        state.close()


@pytest.fixture
def state(make_state) -> ClusterState:
    return make_state()


def create_record(instance_id: str, role: str = "decode", tp_size: int = 1, **kw) -> InstanceRecord:
    endpoints = [] if role == "prefill" else [("127.0.0.1", 29500 + r) for r in range(tp_size)]
    return InstanceRecord(instance_id, role, tp_size, kw.pop("kv_endpoints", endpoints), **kw)


def ids(records) -> list[str]:
    return [r.instance_id for r in records]


def test_register_get_list_update_remove(state):
    """Records round-trip field by field, load updates merge, get returns a copy, remove forgets."""
    before = time.time()
    state.register(create_record("d0", "decode", tp_size=2, load={"running": 1}, max_model_len=4096, block_size=256))
    state.register(create_record("p0", "prefill"))
    d0 = state.get("d0")
    assert (d0.role, d0.tp_size, d0.health, d0.max_model_len, d0.block_size) == ("decode", 2, "healthy", 4096, 256)
    assert (state.get("p0").max_model_len, state.get("p0").block_size) == (0, 0)
    assert d0.kv_endpoints == [("127.0.0.1", 29500), ("127.0.0.1", 29501)]
    assert d0.load == {"running": 1.0} and d0.updated_at >= before
    assert state.get("p0").kv_endpoints == [] and state.get("nope") is None
    assert ids(state.list_instances()) == ["d0", "p0"]

    state.update_load("d0", {"waiting": 3, "kv_usage": 0.25})
    state.update_load("d0", {"running": 4})
    assert state.get("d0").load == {"running": 4.0, "waiting": 3.0, "kv_usage": 0.25}
    d0 = state.get("d0")
    d0.load["running"] = 99
    d0.kv_endpoints.clear()
    assert state.get("d0").load["running"] == 4.0 and len(state.get("d0").kv_endpoints) == 2

    state.remove("d0")
    state.remove("d0")  # idempotent
    assert state.get("d0") is None and ids(state.list_instances()) == ["p0"]


ENGINE = {"dtype": "bfloat16", "linear_layers": "int4: group-wise 32, torch kernel (120 layers)", "attention": "torch",
          "kv_cache_dtype": "bfloat16"}


def test_engine_round_trips_and_defaults_to_empty(state):
    """The engine's choices at load round-trip (each get a copy) and survive load and health
    writes; a record without them, or one an older version wrote to Redis (no `engine` field
    at all), reads as {}."""
    state.register(create_record("d0", engine=ENGINE))
    state.register(create_record("d1"))
    state.update_load("d0", {"running": 1})
    state.set_health("d0", "draining")
    d0 = state.get("d0")
    assert d0.engine == ENGINE and state.get("d1").engine == {}
    d0.engine.clear()
    assert [r.engine for r in state.list_instances()] == [ENGINE, {}]
    if isinstance(state, RedisState):
        state._redis.hdel(state._key("inst", "d0"), "engine")
        assert state.get("d0").engine == {} and state.get("d0").load == {"running": 1.0}


RANK_CPUS = [{"niceness": 0, "cpus": "1", "num_threads": 31, "intraop_threads": 1, "adapt_threads": True,
              "omp_wait_policy": "default"}, {"niceness": 0, "cpus": "2-3", "num_threads": 30, "intraop_threads": 2,
                                              "adapt_threads": False, "omp_wait_policy": "PASSIVE"}]


def test_rank_cpus_round_trip_and_default_to_empty(state):
    """How each rank shares its host's CPUs round-trips per rank (a copy each get) through load and
    health writes; a record without it, or one an older version wrote to Redis, reads as []."""
    state.register(create_record("d0", tp_size=2, rank_cpus=RANK_CPUS))
    state.register(create_record("d1"))
    state.update_load("d0", {"running": 1})
    state.set_health("d0", "draining")
    d0 = state.get("d0")
    assert d0.rank_cpus == RANK_CPUS and state.get("d1").rank_cpus == []
    d0.rank_cpus[0].clear()
    assert [r.rank_cpus for r in state.list_instances()] == [RANK_CPUS, []]
    if isinstance(state, RedisState):
        state._redis.hdel(state._key("inst", "d0"), "rank_cpus")
        assert state.get("d0").rank_cpus == []


def test_register_replaces_record_and_heartbeat(state):
    """Re-registering an id (a restarted instance) starts it clean: no load, no armed TTL."""
    state.register(create_record("d0", load={"running": 2}))
    state.heartbeat("d0", 0.05)
    time.sleep(0.15)
    assert state.expired_instances() == ["d0"]
    state.register(create_record("d0", tp_size=2))
    assert state.get("d0").tp_size == 2 and state.get("d0").load == {}
    assert state.expired_instances() == [] and ids(state.list_instances(healthy_only=True)) == ["d0"]


def test_version_moves_with_membership_not_with_loads(state):
    """Register, health and remove move the version (a gateway re-reads then); heartbeats and loads
    (every probe) do not."""
    seen = [state.version()]
    state.register(create_record("d0"))
    seen.append(state.version())
    state.heartbeat("d0", 5.0)
    state.update_load("d0", {"running": 2})
    state.report({"d0": {"running": 3}}, 5.0)
    seen.append(state.version())
    state.set_health("d0", "draining")
    seen.append(state.version())
    state.remove("d0")
    seen.append(state.version())
    assert seen[0] != seen[1] == seen[2] != seen[3] != seen[4] and len(set(seen)) == 4


def test_report_heartbeats_and_loads_many_and_names_the_missing(state):
    """One call for a probe's answers: each known instance heartbeated with its figures merged;
    the unknown ones named (the controller registers them again)."""
    for iid in ("d0", "d1"):
        state.register(create_record(iid, load={"kv_usage": 0.5}))
    assert state.report({"d0": {"running": 1}, "gone": {"running": 9}, "d1": {"running": 4}}, 0.5) == ["gone"]
    assert [(r.instance_id, r.load) for r in state.list_instances()] == [
        ("d0", {"kv_usage": 0.5, "running": 1.0}), ("d1", {"kv_usage": 0.5, "running": 4.0})]
    assert state.expired_instances() == []
    time.sleep(0.7)
    assert state.expired_instances() == ["d0", "d1"]  # (the TTL of the report's heartbeats)
    with pytest.raises(ValueError):
        state.report({"d0": {}}, 0)


def test_unknown_instance(state):
    """Writes to an unknown instance raise KeyError; removals of one are no-ops."""
    for call in (lambda: state.update_load("x", {"running": 1}), lambda: state.set_health("x", "dead"),
                 lambda: state.heartbeat("x", 1.0)):
        with pytest.raises(KeyError):
            call()
    state.remove("x")
    assert state.list_instances() == []


def test_role_and_health_filters(state):
    """list_instances filters by role; healthy_only drops draining and dead instances."""
    for i, role in (("c0", "colocated"), ("d0", "decode"), ("d1", "decode"), ("p0", "prefill"), ("p1", "prefill")):
        state.register(create_record(i, role))
    assert ids(state.list_instances(role="prefill")) == ["p0", "p1"]
    state.set_health("d1", "draining")
    state.set_health("p0", "dead")
    assert state.get("d1").health == "draining"
    assert ids(state.list_instances(healthy_only=True)) == ["c0", "d0", "p1"]
    assert ids(state.list_instances(role="decode", healthy_only=True)) == ["d0"]
    assert ids(state.list_instances(role="decode")) == ["d0", "d1"]
    state.set_health("d1", "healthy")
    assert ids(state.list_instances(role="decode", healthy_only=True)) == ["d0", "d1"]
    with pytest.raises(ValueError, match="health"):
        state.set_health("d0", "sleepy")


def test_heartbeat_ttl_expiry(state):
    """An expired heartbeat hides the instance from healthy lists and reports it; a fresh
    heartbeat revives it; an instance that never sent one is not subject to expiry."""
    for i in ("a", "b", "c"):
        state.register(create_record(i))
    state.heartbeat("a", 30.0)
    state.heartbeat("b", 0.3)
    assert state.expired_instances() == []
    assert ids(state.list_instances(healthy_only=True)) == ["a", "b", "c"]
    time.sleep(0.5)
    assert state.expired_instances() == ["b"]
    assert ids(state.list_instances(healthy_only=True)) == ["a", "c"]
    assert ids(state.list_instances()) == ["a", "b", "c"]  # the record stays until removed
    state.heartbeat("b", 30.0)
    assert state.expired_instances() == [] and ids(state.list_instances(healthy_only=True)) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        state.heartbeat("a", 0)


def test_metrics_window(make_state):
    """recent_metrics returns the samples inside the window, oldest first; equal samples are
    all kept; samples older than the retention are trimmed."""
    state = make_state(metric_retention_s=60.0)
    now = time.time()
    for ts, value in ((now - 10, 1.0), (now - 1, 3.0), (now - 5, 2.0), (now - 1, 3.0)):
        state.record_metric("ttft_s", value, ts=ts)
    state.record_metric("ttft_s", 4)
    state.record_metric("other", 9.0)
    recent = state.recent_metrics("ttft_s", 3.0)
    assert [v for _, v in recent] == [3.0, 3.0, 4.0]
    assert all(now - 1.01 <= ts <= time.time() for ts, _ in recent)
    assert [v for _, v in state.recent_metrics("ttft_s", 30.0)] == [1.0, 2.0, 3.0, 3.0, 4.0]
    assert state.recent_metrics("missing", 30.0) == []
    state.record_metric("ttft_s", 0.5, ts=now - 120)  # beyond retention: trimmed at once
    assert [v for _, v in state.recent_metrics("ttft_s", 1000.0)] == [1.0, 2.0, 3.0, 3.0, 4.0]


def test_concurrent_updates_from_threads(state):
    """Threads writing load figures, heartbeats and health of one instance lose no write."""
    num_threads, num_iters = 6, 40
    state.register(create_record("d0"))
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for k in range(num_iters):
                state.update_load("d0", {f"t{t}": k})
                state.heartbeat("d0", 30.0)
                state.set_health("d0", "healthy" if k % 2 else "draining")
                state.register(create_record(f"x{t}-{k}", "prefill"))
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    record = state.get("d0")
    assert record.load == {f"t{t}": float(num_iters - 1) for t in range(num_threads)}
    assert record.health == "healthy"  # every thread's last write
    assert len(state.list_instances(role="prefill")) == num_threads * num_iters


def test_instance_record_validation():
    """Bad roles, health, TP sizes and endpoint counts are rejected when the record is built."""
    with pytest.raises(ValueError, match="role"):
        InstanceRecord("i", "router", 1)
    with pytest.raises(ValueError, match="health"):
        InstanceRecord("i", "decode", 1, health="ok")
    with pytest.raises(ValueError, match="tp_size"):
        InstanceRecord("i", "decode", 0)
    with pytest.raises(ValueError, match="kv_endpoints"):
        InstanceRecord("i", "decode", 2, [("h", 1)])
    assert InstanceRecord("i", "decode", 1, [["h", "7"]]).kv_endpoints == [("h", 7)]


def test_create_state(redis_url):
    """create_state picks the backend from the URL and rejects unknown schemes."""
    assert isinstance(create_state(None), MemoryState)
    assert isinstance(create_state("memory://"), MemoryState)
    state = create_state(redis_url)
    assert isinstance(state, RedisState)
    state.close()
    with pytest.raises(ValueError, match="memory://"):
        create_state("http://localhost:6379")


def test_redis_states_share_one_namespace(redis_url):
    """Two RedisState clients (two processes, in effect) see each other's writes within a
    namespace, and nothing across namespaces."""
    a, b, other = RedisState(redis_url, "share"), RedisState(redis_url, "share"), RedisState(redis_url, "other")
    try:
        a.remove("d0")
        other.remove("d0")
        a.register(create_record("d0"))
        b.update_load("d0", {"running": 2})
        assert a.get("d0").load == {"running": 2.0}
        assert other.get("d0") is None and other.list_instances() == []
    finally:
        for s in (a, b, other):
            s.close()


@pytest.mark.parametrize("spoil", [{b"role": b"\xc1"}, {b"tp_size": None}], ids=["not msgpack", "field missing"])
def test_a_malformed_redis_record_is_skipped_not_fatal(redis_url, spoil):
    """One record a stranger (or an older version) spoiled is skipped, logged once and counted;
    every reader still lists the other instances, so no gateway's sync stops on it."""
    state = RedisState(redis_url, namespace="malformed")
    state._redis.flushdb()
    state.register(create_record("decode-0"))
    state.register(create_record("decode-1"))
    key = state._key("inst", "decode-1")
    for field, value in spoil.items():
        state._redis.hdel(key, field) if value is None else state._redis.hset(key, field, value)
    assert ids(state.list_instances()) == ["decode-0"] and state.get("decode-1") is None
    assert ids(state.list_instances()) == ["decode-0"] and state.malformed_records == 3
    state.close()
