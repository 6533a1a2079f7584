"""/status shows every instance's ranks (addresses, pids) and load: with API keys configured it
needs one (401 without, no limits counted against it), and however often it is read, each
instance is asked for its expert counts at most once per ExpertCountCache.ttl_s (it used to be one
Ray call per instance per read)."""
from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from gateway.app import ExpertCountCache
from tests.gateway.test_api_keys import A, app, keys


class CountingClient:
    def __init__(self):
        self.calls = 0
        self.info = SimpleNamespace(healthy=True, load={}, engine={})

    def expert_counts(self):
        self.calls += 1
        return {}


def instance(iid: str, client: CountingClient):
    return SimpleNamespace(instance_id=iid, role="decode", tp_size=1, client=client, placements=[])


def test_status_needs_a_key_where_keys_are_configured(cluster, tokenizer):
    client = TestClient(app(cluster, tokenizer, api_keys=keys()))
    r = client.get("/status")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/status", headers=A).status_code == 200
    assert client.get("/health").status_code == 200  # probes stay open
    open_client = TestClient(app(cluster, tokenizer))
    assert open_client.get("/status").status_code == 200  # no keys at all: the API is open, and so is this


def test_expert_counts_are_asked_once_per_ttl_however_often_status_is_read(cluster, tokenizer):
    counting = CountingClient()
    cluster.instances = {"decode-0": instance("decode-0", counting)}
    client = TestClient(app(cluster, tokenizer))
    for _ in range(20):
        assert client.get("/status").json()["instances"][0]["expert_counts"] == {}
    assert counting.calls == 1


def test_the_cache_asks_again_after_its_ttl_and_forgets_instances_gone():
    a, b = CountingClient(), CountingClient()
    cache = ExpertCountCache(ttl_s=0.0)
    cache.get([instance("a", a), instance("b", b)])
    cache.get([instance("a", a)])
    assert (a.calls, b.calls) == (2, 1) and set(cache._seen) == {"a"}
