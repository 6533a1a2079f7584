"""Named API keys and their limits (gateway/api_keys.py, gateway/guard.py) over a fake cluster:
who gets in, a key's rate and concurrency limits (429 with Retry-After, the other keys served),
slots released however a response ends, the body and prompt bounds, per-key metrics, and no key
in any log."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster.cli.serve import serve_in_thread
from gateway.api_keys import APIKey, configured_keys, hash_api_key, load_api_keys
from gateway.app import create_app
from gateway.guard import APIKeyManager
from gateway.limits import KeyLimitError
from router.tables import StreamEvent
from tests.gateway.fakes import TOKENS, FakeCluster

pytestmark = pytest.mark.timeout(120)
KEY_A, KEY_B = "sk-team-a-7f3c9e1d2b", "sk-team-b-0a4e6c8d1f"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}


def keys(a: dict | None = None, b: dict | None = None) -> list[APIKey]:
    """team-a and team-b, with the limits given (none: unlimited)."""
    return [APIKey("team-a", hash_api_key(KEY_A), **(a or {})), APIKey("team-b", hash_api_key(KEY_B), **(b or {}))]


def app(cluster, tokenizer, **kw):
    return create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len, **kw)


def chat(**kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 3, **kw}


def metric(text: str, name: str, **labels) -> float | None:
    """One sample's value from Prometheus text; None when the series is absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def test_each_key_gets_in_and_a_wrong_or_missing_one_is_401(cluster, tokenizer):
    """Both named keys and the single --api-key ("default") are served; a wrong, missing or
    non-bearer one is a 401 with the OpenAI body; probes need no key."""
    c = TestClient(app(cluster, tokenizer, api_keys=keys(), api_key="sk-single"))
    for headers in (A, B, {"Authorization": "Bearer sk-single"}, {"Authorization": f"bearer {KEY_A}"}):
        assert c.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200, headers
    submitted = len(cluster.submitted)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY_A},
                    {"Authorization": f"Basic {KEY_A}"}, {"Authorization": "Bearer "}):
        r = c.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert len(cluster.submitted) == submitted
    assert c.get("/v1/models", headers=B).status_code == 200 and c.get("/v1/models").status_code == 401
    assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200


def test_a_key_over_its_rate_gets_429_while_the_other_is_served(cluster, tokenizer):
    """team-a (0.1 requests/s, burst 2): its third request is a 429 of OpenAI's shape with a
    whole-seconds Retry-After from its bucket (about 10 s); team-b, unlimited, is served."""
    c = TestClient(app(cluster, tokenizer, api_keys=keys(a={"requests_per_second": 0.1, "burst": 2})))
    assert [c.post("/v1/chat/completions", json=chat(), headers=A).status_code for _ in range(2)] == [200, 200]
    r = c.post("/v1/chat/completions", json=chat(), headers=A)
    assert r.status_code == 429 and 8 <= int(r.headers["retry-after"]) <= 10, r.headers
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "team-a" in error["message"]
    assert [c.post("/v1/chat/completions", json=chat(), headers=B).status_code for _ in range(5)] == [200] * 5
    assert c.get("/v1/models", headers=A).status_code == 429  # every /v1 route takes from the bucket
    assert len(cluster.submitted) == 7


def test_bucket_and_concurrency_arithmetic():
    """On a fake clock: the bucket refills at its rate up to its size and Retry-After is the whole
    seconds to the next token; burst defaults to the rate rounded up; a request refused for
    concurrency takes no token."""
    now = [0.0]
    manager = APIKeyManager([APIKey("a", hash_api_key("ka"), requests_per_second=0.5, burst=2),
                             APIKey("c", hash_api_key("kc"), requests_per_second=1.0, max_concurrent=1),
                             APIKey("d", hash_api_key("kd"), requests_per_second=2.5)], clock=lambda: now[0])
    a, c, d = manager.keys
    admit = lambda key: asyncio.run(manager.admit(key))  # noqa: E731
    admit(a)
    admit(a)
    for t, retry in ((0.0, "2"), (1.0, "1"), (1.9, "1")):
        now[0] = t
        with pytest.raises(KeyLimitError) as refused:
            admit(a)
        assert (refused.value.outcome, refused.value.headers["Retry-After"]) == ("rate_limited", retry)
    now[0] = 2.0
    admit(a)
    assert d.bucket_size == 3 and c.bucket_size == 1
    now[0] = 5.0
    hold = admit(c)
    now[0] = 6.0  # a token is back, but the one slot is taken
    with pytest.raises(KeyLimitError) as refused:
        admit(c)
    assert (refused.value.outcome, refused.value.headers["Retry-After"]) == ("concurrency_limited", "1")
    asyncio.run(manager.release(hold))
    admit(c)  # the refused request took no token: this one finds it
    assert manager.limits.local.in_flight == {"a": 3, "c": 1, "d": 0}


class HoldingCluster(FakeCluster):
    """Holds every request (no token) until `finish()`, so a stream stays open."""

    def __init__(self):
        super().__init__()
        self.held = []

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.submitted.append((request_id, prompt_token_ids, params))
        self.held.append(listener)

    def finish(self):
        for listener in self.held:
            listener(StreamEvent(TOKENS[:1]))
            listener(StreamEvent([], True, "stop"))
        self.held.clear()


def wait_in_flight(http: httpx.Client, key: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while metric(http.get("/metrics").text, "pdserve_api_key_in_flight_requests", key=key) != value:
        assert time.monotonic() < deadline, f"{key} never had {value} requests in flight"
        time.sleep(0.02)


def test_a_held_stream_holds_its_slot_until_it_ends_or_is_cancelled(tokenizer):
    """team-a may have one request in flight: while its stream is open its next request is a 429
    (Retry-After 1) and team-b is served; the slot is free again once the stream ends, and once
    the client cancels one (whose request is then aborted on the cluster)."""
    cluster = HoldingCluster()
    url, stop = serve_in_thread(app(cluster, tokenizer, api_keys=keys(a={"max_concurrent": 1})))
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            for ending in ("finished", "cancelled"):
                with http.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=A) as held:
                    lines = held.iter_lines()
                    assert next(lines).startswith("data: {")  # the role chunk: the stream is open
                    r = http.post("/v1/chat/completions", json=chat(), headers=A)
                    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "concurrency" in r.text
                    assert http.get("/v1/models", headers=B).status_code == 200
                    assert metric(http.get("/metrics").text, "pdserve_api_key_in_flight_requests", key="team-a") == 1
                    if ending == "finished":
                        threading.Thread(target=cluster.finish).start()
                        assert [ln for ln in lines if ln][-1] == "data: [DONE]"
                wait_in_flight(http, "team-a", 0)
                assert http.get("/v1/models", headers=A).status_code == 200
            rid = cluster.submitted[-1][0]
            deadline = time.monotonic() + 10
            while rid not in cluster.aborted:  # the cancelled stream's request, aborted on the cluster
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        stop()


def test_per_key_metrics_and_no_key_in_logs(cluster, tokenizer, caplog):
    """/metrics counts each key's requests by outcome and its in-flight ones under the key's NAME
    (no key: `_none`); an error's log names the key; no key text is in any log or on /metrics,
    and an error releases the key's slot."""
    caplog.set_level(logging.DEBUG)
    c = TestClient(app(cluster, tokenizer, api_keys=keys(a={"requests_per_second": 0.01, "burst": 1,
                                                            "max_concurrent": 1})), raise_server_exceptions=False)
    assert c.post("/v1/chat/completions", json=chat(), headers=A).status_code == 200
    assert c.post("/v1/chat/completions", json=chat(), headers=A).status_code == 429
    assert c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-team-c-wrong"}
                  ).status_code == 401

    def broken(*args, **kwargs):
        raise RuntimeError("the cluster broke")
    cluster.submit = broken
    assert c.post("/v1/chat/completions", json=chat(), headers=B).status_code == 500
    text = c.get("/metrics").text
    assert metric(text, "pdserve_api_key_requests_total", key="team-a", outcome="served") == 1
    assert metric(text, "pdserve_api_key_requests_total", key="team-a", outcome="rate_limited") == 1
    assert metric(text, "pdserve_api_key_requests_total", key="team-b", outcome="served") == 1
    assert metric(text, "pdserve_api_key_requests_total", key="_none", outcome="unauthorized") == 1
    assert metric(text, "pdserve_api_key_requests_total", key="team-b", outcome="concurrency_limited") == 0
    assert metric(text, "pdserve_api_key_in_flight_requests", key="team-b") == 0  # the 500 released it
    assert "unhandled error (API key team-b)" in caplog.text and "team-a" in caplog.text
    for secret in (KEY_A, KEY_B, "sk-team-c-wrong", "7f3c9e1d2b"):
        assert secret not in caplog.text and secret not in text


def test_oversized_bodies_are_413_before_anything_is_parsed(cluster, tokenizer):
    """Over --max-request-bytes: 413 with the OpenAI body, from Content-Length or, chunked without
    one, from the bytes read; the cluster never sees the request. A body within it is served."""
    c = TestClient(app(cluster, tokenizer, api_keys=keys(), max_request_bytes=2048))
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 3000}])).encode()

    def chunked():
        yield from (big[i:i + 500] for i in range(0, len(big), 500))
    for kwargs in ({"content": big}, {"content": chunked()}):
        r = c.post("/v1/chat/completions", headers={**A, "content-type": "application/json"}, **kwargs)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert "2048 bytes" in r.json()["error"]["message"]
    assert cluster.submitted == []
    assert c.post("/v1/chat/completions", json=chat(), headers=A).status_code == 200
    text = c.get("/metrics").text
    assert metric(text, "pdserve_api_key_requests_total", key="team-a", outcome="too_large") == 2


def test_a_chunked_body_is_not_read_past_the_bound(cluster, tokenizer):
    """A chunked body with no end: the guard stops reading at the first chunk past the bound and
    answers 413; the route never runs."""
    application = app(cluster, tokenizer, api_keys=keys(), max_request_bytes=2048)
    received, sent = [], []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"authorization", f"Bearer {KEY_A}".encode()),
                                                               (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(application(scope, receive, send))
    assert sent[0]["status"] == 413 and len(received) == 3 and cluster.submitted == []


def test_too_many_prompt_tokens_is_400(cluster, tokenizer):
    """--max-prompt-tokens 5: a 6-token prompt is a 400 naming both numbers (completions and
    chat); 5 tokens are served."""
    c = TestClient(app(cluster, tokenizer, max_prompt_tokens=5))
    r = c.post("/v1/completions", json={"model": "smollm2", "prompt": [1] * 6, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "6 tokens" in r.json()["error"]["message"] and "at most 5" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "at most 5" in r.text
    assert cluster.submitted == []
    assert c.post("/v1/completions", json={"model": "smollm2", "prompt": [1] * 5, "max_tokens": 2}).status_code == 200


def write(tmp_path, data) -> str:
    path = tmp_path / "keys.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_keys_file_round_trip_and_default_key(tmp_path):
    """A file's entries become keys (sha256 case-folded, burst only with a rate); the single
    api_key joins them as "default", unless the file already has that name or that key."""
    digest = hash_api_key(KEY_A)
    path = write(tmp_path, {"keys": [{"name": "team-a", "sha256": digest.upper(), "requests_per_second": 5,
                                      "burst": 10, "max_concurrent": 4}, {"name": "b.2", "sha256": hash_api_key("x")}]})
    assert load_api_keys(path) == [APIKey("team-a", digest, 5.0, 10, 4), APIKey("b.2", hash_api_key("x"))]
    assert [k.name for k in configured_keys("sk-single", path)] == ["team-a", "b.2", "default"]
    assert configured_keys("sk-single", None) == [APIKey("default", hash_api_key("sk-single"))]
    assert configured_keys(None, None) == []
    with pytest.raises(ValueError, match="same hash"):
        configured_keys(KEY_A, path)


@pytest.mark.parametrize("data, message", [
    ("{not json", "not JSON"),
    ([], r'expected an object \{"keys": \[...\]\}'),
    ({"keys": [], "extra": 1}, "expected an object"),
    ({"keys": []}, "keys is empty"),
    ({"keys": ["team-a"]}, r"keys\[0\] must be an object"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "rate": 1}]}, r"keys\[0\]: unknown field\(s\) rate"),
    ({"keys": [{"name": "-a", "sha256": "0" * 64}]}, r"keys\[0\]\.name must be"),
    ({"keys": [{"name": "a", "sha256": KEY_A}]}, r"keys\[0\]\.sha256 must be 64 hex digits"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "requests_per_second": 0}]},
     r"keys\[0\]\.requests_per_second must be a number > 0 or absent, got 0"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "requests_per_second": True}]},
     r"keys\[0\]\.requests_per_second must be a number > 0 or absent, got true"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "burst": 3}]}, r"keys\[0\]\.burst needs requests_per_second"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "requests_per_second": 1, "burst": 1.5}]},
     r"keys\[0\]\.burst must be an integer >= 1"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "max_concurrent": 0}]},
     r"keys\[0\]\.max_concurrent must be an integer >= 1"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]},
     "the key name 'a' is given twice"),
])
def test_keys_file_errors_name_the_file_and_the_problem(tmp_path, data, message):
    """Each bad keys file is one ValueError line starting with the file, naming what is wrong."""
    path = write(tmp_path, data)
    with pytest.raises(ValueError, match=f"^api_keys_file {re.escape(path)}: {message}") as error:
        load_api_keys(path)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="cannot read it"):
        load_api_keys(tmp_path / "missing.json")


def test_a_key_that_isolates_its_cache_salts_every_request_with_its_name(cluster, tokenizer, tmp_path):
    """isolate_cache: team-a's requests reach the cluster salted by its name (before the request's own
    salt), team-b's with their own salt or none; the keys file takes only true or false for it."""
    c = TestClient(app(cluster, tokenizer, api_keys=keys(a={"isolate_cache": True})))
    for headers, body in ((A, chat()), (A, chat(cache_salt="mine")), (B, chat()), (B, chat(cache_salt="mine"))):
        assert c.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
    assert [p.cache_salt for _, _, p in cluster.submitted] == ["key:team-a", "key:team-a/mine", None, "mine"]
    path = tmp_path / "keys.json"
    entry = {"name": "a", "sha256": hash_api_key(KEY_A), "isolate_cache": "yes"}
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(ValueError, match=r"keys\[0\].isolate_cache must be true or false"):
        load_api_keys(path)
    path.write_text(json.dumps({"keys": [{**entry, "isolate_cache": True}]}))
    assert load_api_keys(path)[0].cache_salt == "key:a"
