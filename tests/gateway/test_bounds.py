"""Bounds where the gateway does work, over a fake cluster: lists and maps past their counts are a
short 400 naming the field before anything else runs (never echoing what was sent), a text prompt
past its character bound is refused before it is tokenized, parsing and tokenizing leave the event
loop free, and a body on a path outside /v1 is refused at once, unread."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster.cli.serve import serve_in_thread
from gateway.app import create_app
from gateway.protocol import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOOLS
from tests.gateway.fakes import FakeCluster

pytestmark = pytest.mark.timeout(120)
MARKER = "zq-block-here"  # a body or prompt holding it blocks in json.loads / encode until released
SHORT = 200  # an error message's most characters


@pytest.fixture
def client(cluster, tokenizer):
    return TestClient(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))


def chat(**kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Capital of France?"}], **kw}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


def test_ten_thousand_stop_ids_are_a_short_400_at_once(client, cluster):
    """10,000 stop_token_ids: 400 naming the field and the count, well under a second (measured
    measured 4-70 ms), a message that does not repeat the ids; nothing reaches the cluster."""
    start = time.monotonic()
    r = client.post("/v1/chat/completions", json=chat(stop_token_ids=list(range(10_000))))
    elapsed = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    message = r.json()["error"]["message"]
    assert f"at most {MAX_STOP_TOKEN_IDS}" in message and "10000" in message and len(r.content) < 2 * SHORT
    assert elapsed < 1.0 and cluster.submitted == []


@pytest.mark.parametrize("field,value,bound", [
    ("logit_bias", {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
    ("stop", [f"s{i}" for i in range(MAX_STOP + 1)], f"at most {MAX_STOP}"),
    ("stop", "x" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS} characters"),
    ("stop", ["a", "y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
    ("tools", [tool(i) for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS}"),
])
def test_counts_past_their_bounds_are_400s_naming_the_field(client, cluster, field, value, bound):
    """Each list or map past its bound is a 400 naming the field and the bound, in a short message;
    nothing reaches the cluster."""
    r = client.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert bound in r.json()["error"]["message"] and len(r.json()["error"]["message"]) < SHORT
    assert cluster.submitted == []


def test_counts_at_their_bounds_are_served(client, cluster):
    """stop_token_ids, logit_bias and stop strings exactly at their bounds are taken as given."""
    body = chat(max_tokens=2, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), stop=["z" * MAX_STOP_CHARS] * MAX_STOP,
                logit_bias={str(i): 0.5 for i in range(MAX_LOGIT_BIAS)})
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    params = cluster.submitted[0][2]
    assert len(params.stop_token_set) == MAX_STOP_TOKEN_IDS and len(params.logit_bias) == MAX_LOGIT_BIAS


@pytest.mark.parametrize("field,value,shown", [
    ("stop_token_ids", [5] * 1000 + [-1, 7_777_777], "-1"),
    ("logit_bias", {"1" * 5000: 1.0}, "111"),  # past int()'s digits: was a 500
    ("logit_bias", {"\u00b2": 1.0}, "\u00b2"),  # a digit to str.isdigit, not to int(): was a 500
    ("suffix", "x" * 100_000, "xxx"),
])
def test_refused_values_are_named_not_echoed(client, field, value, shown):
    """A 400 for a bad value shows at most the first offending one, cut short: never the whole
    list or string the body sent."""
    body = {"model": "smollm2", "prompt": "hi", field: value}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    message = r.json()["error"]["message"]
    assert shown in message and len(message) < SHORT and "7777777" not in message


def test_a_text_prompt_past_its_character_bound_is_never_tokenized(cluster, tokenizer, monkeypatch):
    """Over 32 characters per token of the context: a 400 naming the characters, before the
    tokenizer sees the prompt; chat messages alike (the rendered template is measured)."""
    seen = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: seen.append(len(text)) or [1])
    c = TestClient(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    r = c.post("/v1/completions", json={"model": "smollm2", "prompt": "a" * (32 * FakeCluster.max_model_len + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "characters" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "b" * 9000}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert seen == [] and cluster.submitted == []


def test_no_instance_known_yet_is_not_ready_never_a_400(cluster, tokenizer):
    """A gateway that knows no instance yet (its context length 0: the cluster's, asked per
    request) has no character bound to apply: a prompt gets the not-ready 503 with Retry-After,
    as any request then, not a 400 "at most 0 characters" (the 10-minute chaos run found that)."""
    cluster.max_model_len, cluster.is_ready = 0, False
    c = TestClient(create_app(cluster, tokenizer, "smollm2", None))
    for path, body in (("/v1/completions", {"model": "smollm2", "prompt": "The capital of France is"}),
                       ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi"}]))):
        r = c.post(path, json=body)
        assert r.status_code == 503 and "retry-after" in r.headers, (path, r.text)
    assert cluster.submitted == []


class _Blocker:
    """Blocks the thread that meets MARKER until released (5 s at most: then it notes the wait ran
    out, which is what a blocked event loop makes happen)."""

    def __init__(self):
        self.entered, self.release, self.gave_up = threading.Event(), threading.Event(), False

    def wait_if_marked(self, data) -> None:
        if (MARKER.encode() if isinstance(data, (bytes, bytearray)) else MARKER) in data:
            self.entered.set()
            self.gave_up = not self.release.wait(5)


async def _health_while_blocked(app, blocker: _Blocker, path: str, body: dict) -> tuple[int, int]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        slow = asyncio.create_task(c.post(path, json=body))
        while not blocker.entered.is_set():
            await asyncio.sleep(0.01)
        health = await asyncio.wait_for(c.get("/health"), 5)  # the loop is free meanwhile
        blocker.release.set()
        return health.status_code, (await asyncio.wait_for(slow, 10)).status_code


def test_parsing_leaves_the_event_loop_free(cluster, tokenizer, monkeypatch):
    """/health answers while a body is being parsed (json.loads held in the middle); the request is
    then served."""
    blocker, loads = _Blocker(), json.loads

    def blocking_loads(data, *args, **kwargs):
        blocker.wait_if_marked(data)
        return loads(data, *args, **kwargs)
    monkeypatch.setattr(json, "loads", blocking_loads)
    app = create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len)
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "user": MARKER}
    assert asyncio.run(_health_while_blocked(app, blocker, "/v1/completions", body)) == (200, 200)
    assert not blocker.gave_up


def test_tokenizing_leaves_the_event_loop_free(cluster, tokenizer, monkeypatch):
    """/health answers while a chat prompt is being tokenized (encode held in the middle)."""
    blocker, encode = _Blocker(), tokenizer.encode

    def blocking_encode(text, *args, **kwargs):
        blocker.wait_if_marked(text)
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", blocking_encode)
    app = create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len)
    body = chat(max_tokens=2, messages=[{"role": "user", "content": MARKER}])
    assert asyncio.run(_health_while_blocked(app, blocker, "/v1/chat/completions", body)) == (200, 200)
    assert not blocker.gave_up


def test_a_body_outside_v1_is_refused_unread(cluster, tokenizer):
    """A request outside /v1 that announces a body (8 MiB, or chunked) is a 413 at once: the body
    is never asked for (it never comes). Without one, /health answers as ever."""
    app = create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len)
    for path, header in (("/health", (b"content-length", b"8388608")), ("/metrics", (b"transfer-encoding", b"chunked"))):
        sent, received = [], []

        async def receive():
            received.append(1)
            await asyncio.Event().wait()  # the announced body never arrives

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [header],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
        assert sent[0]["status"] == 413 and received == []
    assert TestClient(app).get("/health").status_code == 200


def test_a_body_outside_v1_gets_its_answer_over_a_socket_at_once(cluster, tokenizer):
    """Over TCP against uvicorn: `POST /health` announcing 8 MiB and sending none is answered 413
    and the connection closed, within 5 s (measured: milliseconds; it used to hang 10 s)."""
    url, stop = serve_in_thread(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    try:
        where = urlsplit(url)
        with socket.create_connection((where.hostname, where.port), timeout=5) as sock:
            sock.sendall(b"POST /health HTTP/1.1\r\nHost: gw\r\nContent-Length: 8388608\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):  # socket.timeout after 5 s: no answer
                data += chunk
        assert data.startswith(b"HTTP/1.1 413") and b"takes no request body" in data
    finally:
        stop()
