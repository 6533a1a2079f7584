"""Tenants at the gateway (issue 54): a key's priority class and weight reach the router, its token
budget refuses work in tokens, and its limits hold across gateways through one Redis (with each
gateway on its own, and saying so, while Redis is down)."""
from __future__ import annotations

import json
import logging
import re
import time

import pytest
from fastapi.testclient import TestClient

from cluster.cli.serve import shared_limits
from gateway.api_keys import load_api_keys
from tests.conftest import _start_redis, stop_server
from tests.gateway.fakes import FakeCluster
from tests.gateway.test_api_keys import A, B, app, chat, keys, metric

pytestmark = pytest.mark.timeout(120)


def plain(text: str, name: str) -> float | None:
    """A label-less sample's value from Prometheus text."""
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


class PlacementCluster(FakeCluster):
    """Records the tenant and weight each request is submitted with."""

    def __init__(self):
        super().__init__()
        self.placements = []

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.placements.append((params.priority, *tenant))
        return super().submit(request_id, prompt_token_ids, params, listener, session, trace)


def test_a_keys_class_and_weight_reach_the_router(tokenizer):
    """team-b's class is 10 and its weight 3: a request naming no priority gets 10, one naming a
    lower class 20; one asking for a more urgent class than its key may is a 400 naming it. Without
    keys, the request's own priority (default 0) and no tenant."""
    cluster = PlacementCluster()
    c = TestClient(app(cluster, tokenizer, api_keys=keys(b={"priority": 10, "weight": 3.0})))
    assert c.post("/v1/chat/completions", json=chat(), headers=A).status_code == 200
    assert c.post("/v1/chat/completions", json=chat(), headers=B).status_code == 200
    assert c.post("/v1/chat/completions", json=chat(priority=20), headers=B).status_code == 200
    r = c.post("/v1/chat/completions", json=chat(priority=0), headers=B)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority" and "its class is 10" in r.text
    assert cluster.placements == [(0, "team-a", 1.0), (10, "team-b", 3.0), (20, "team-b", 3.0)]
    open_cluster = PlacementCluster()
    c = TestClient(app(open_cluster, tokenizer))
    assert c.post("/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2,
                                           "priority": -3}).status_code == 200
    assert open_cluster.placements == [(-3, "", 1.0)]
    text = c.get("/metrics").text
    assert metric(text, "pdserve_tenant_requests_total", key="_none", outcome="admitted", priority="-3") == 1


def test_token_budget_counts_n_times_max_tokens_and_is_refunded(tokenizer):
    """team-a may hold 600 tokens in flight: n=128 x max_tokens 5 is a 429 naming the budget (no
    Retry-After: it can never fit); requests within it pass, one after another (each refunded)."""
    cluster = FakeCluster()
    c = TestClient(app(cluster, tokenizer, api_keys=keys(a={"token_budget": 600})))
    r = c.post("/v1/chat/completions", json=chat(n=128, max_tokens=5), headers=A)
    assert r.status_code == 429 and r.json()["error"]["code"] == "token_budget_exceeded"
    assert "token budget of API key 'team-a' (600)" in r.text and "Retry-After" not in r.headers
    for _ in range(3):
        assert c.post("/v1/chat/completions", json=chat(n=8, max_tokens=50), headers=A).status_code == 200
    text = c.get("/metrics").text
    assert metric(text, "pdserve_api_key_requests_total", key="team-a", outcome="token_limited") == 1
    assert metric(text, "pdserve_tenant_requests_total", key="team-a", outcome="token_limited", priority="0") == 1
    assert len(cluster.submitted) == 3


def test_keys_file_takes_class_weight_and_budget(tmp_path):
    path = tmp_path / "keys.json"
    entry = {"name": "a", "sha256": "0" * 64, "priority": 5, "weight": 0.5, "token_budget": 1000}
    path.write_text(json.dumps({"keys": [entry]}))
    (key,) = load_api_keys(path)
    assert (key.priority, key.weight, key.token_budget, key.limited) == (5, 0.5, 1000, True)
    for field, value, why in (("priority", 1.5, "priority must be an integer"), ("weight", 0, "weight must be"),
                              ("token_budget", -1, "token_budget must be an integer >= 1")):
        path.write_text(json.dumps({"keys": [{**entry, field: value}]}))
        with pytest.raises(ValueError, match=why):
            load_api_keys(path)


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test alone (it stops it)."""
    import shutil
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    proc, port = _start_redis(binary, tmp_path)
    yield proc, f"redis://127.0.0.1:{port}/0"
    if proc.poll() is None:
        stop_server(proc)


def test_two_gateways_share_a_keys_rate_through_redis(tokenizer, private_redis, caplog):
    """team-a: 0.2 requests per second, burst 4. Eight requests spread over two gateways admit 4
    (not 8: each gateway's own bucket would); team-b (no limit) never touches Redis. Redis stopped:
    each gateway falls back to its own bucket, says so once in its log, and counts its decisions."""
    proc, url = private_redis
    rate = {"requests_per_second": 0.2, "burst": 4}
    one, two = (TestClient(app(FakeCluster(), tokenizer, api_keys=keys(a=rate), shared_limits=shared_limits(url)))
                for _ in range(2))
    with one, two:
        start = time.monotonic()
        codes = [(one if i % 2 else two).post("/v1/chat/completions", json=chat(), headers=A).status_code
                 for i in range(8)]
        refills = int(0.2 * (time.monotonic() - start))  # a token per 5 s (a slow box may see one)
        assert codes.count(200) == 4 + min(refills, codes.count(429)) and codes.count(429) >= 4 - refills
        assert one.post("/v1/chat/completions", json=chat(), headers=B).status_code == 200
        assert plain(one.get("/metrics").text, "pdserve_api_key_limits_shared") == 1
        stop_server(proc)
        with caplog.at_level(logging.WARNING, logger="gateway.limits"):
            for c in (one, two):  # each its own full bucket now: admitted again
                assert c.post("/v1/chat/completions", json=chat(), headers=A).status_code == 200
        said = [r for r in caplog.records if "Redis did not answer" in r.getMessage()]
        assert len(said) == 2, [r.getMessage() for r in caplog.records]
        for c in (one, two):
            text = c.get("/metrics").text
            assert plain(text, "pdserve_api_key_limits_shared") == 0
            assert plain(text, "pdserve_api_key_limits_local_decisions_total") >= 1


def test_concurrency_and_token_budget_hold_across_gateways(tokenizer, private_redis):
    """team-a may hold 300 tokens, team-b one request: gateway one's open streams hold both, so
    gateway two refuses the next of each (429); once the streams end, both pass there."""
    from tests.gateway.test_api_keys import HoldingCluster
    _, url = private_redis
    held = HoldingCluster()
    limits = keys(a={"token_budget": 300}, b={"max_concurrent": 1})
    one = TestClient(app(held, tokenizer, api_keys=limits, shared_limits=shared_limits(url)))
    two = TestClient(app(FakeCluster(), tokenizer, api_keys=limits, shared_limits=shared_limits(url)))
    with one, two:
        with one.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=200), headers=A) as ra, \
                one.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=B) as rb:
            assert ra.status_code == rb.status_code == 200
            refused = two.post("/v1/chat/completions", json=chat(max_tokens=100), headers=A)
            assert refused.status_code == 429 and "token budget reached" in refused.text
            assert refused.headers["Retry-After"] == "1"
            refused = two.post("/v1/chat/completions", json=chat(), headers=B)
            assert refused.status_code == 429 and "concurrency limit" in refused.text
            held.finish()
            ra.read()
            rb.read()
        for headers, body in ((A, chat(max_tokens=100)), (B, chat())):
            deadline = time.monotonic() + 10  # the release reaches Redis on a task of its own
            while (code := two.post("/v1/chat/completions", json=body, headers=headers).status_code) == 429:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert code == 200
