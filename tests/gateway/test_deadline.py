"""A request ends, whatever the cluster does: past its deadline (the spec's request_timeout_s) it is
aborted and answered 504 with an OpenAI error body, or on a stream an error chunk and [DONE], and
its API key's slot is released; a non-streaming client that leaves aborts its request even while
tokens keep coming. Over fake clusters, on a real uvicorn."""
from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from cluster.cli.serve import serve_in_thread
from cluster.spec import ClusterSpec
from gateway.app import create_app
from router.tables import StreamEvent
from tests.gateway.fakes import TOKENS, FakeCluster
from tests.gateway.test_api_keys import A, KEY_A, chat, keys, metric, wait_in_flight

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 1.0


class SilentCluster(FakeCluster):
    """Takes every request and never answers it (a router thread that died, a stalled pool)."""

    def __init__(self, request_timeout_s: float):
        super().__init__()
        self.spec = ClusterSpec(request_timeout_s=request_timeout_s)

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.submitted.append((request_id, prompt_token_ids, params))


class TricklingCluster(FakeCluster):
    """Sends a token every 20 ms until the request is aborted (or 30 s pass)."""

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.submitted.append((request_id, prompt_token_ids, params))

        def emit():
            for i in range(1500):
                if request_id in self.aborted:
                    return
                listener(StreamEvent([TOKENS[i % len(TOKENS)]]))
                time.sleep(0.02)
            listener(StreamEvent([], True, "length"))
        threading.Thread(target=emit, daemon=True).start()


def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_past_its_deadline_a_request_gets_504_or_an_error_chunk_and_its_slot_back(tokenizer):
    """team-a may have one request in flight. A request the cluster never answers: 504 with an
    OpenAI error body (type timeout_error, code request_timeout) after about the deadline, and it
    is aborted on the cluster; the slot is free again (the next request is not a 429). A stream:
    the role chunk, then an error chunk and [DONE]. Each one is counted."""
    cluster = SilentCluster(TIMEOUT_S)
    url, stop = serve_in_thread(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len,
                                           api_keys=keys(a={"max_concurrent": 1})))
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(2):  # the second is admitted: the first one's slot was released
                start = time.monotonic()
                r = http.post("/v1/chat/completions", json=chat(), headers=A)
                assert r.status_code == 504, r.text
                assert time.monotonic() - start >= TIMEOUT_S * 0.9
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
                assert "request_timeout_s" in error["message"] and KEY_A not in r.text
                rid = cluster.submitted[-1][0]
                wait_for(lambda: rid in cluster.aborted, "the request was not aborted on the cluster")
                wait_in_flight(http, "team-a", 0)
            with http.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=A) as s:
                lines = [ln for ln in s.iter_lines() if ln]
            assert len(lines) == 3 and json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["role"]
            assert json.loads(lines[1].removeprefix("data: "))["error"]["code"] == "request_timeout"
            assert lines[2] == "data: [DONE]"
            wait_in_flight(http, "team-a", 0)
            wait_for(lambda: cluster.submitted[-1][0] in cluster.aborted, "the stream was not aborted")
            text = http.get("/metrics").text
            assert metric(text, "pdserve_request_deadline_exceeded_total", endpoint="chat") == 3
            assert metric(text, "pdserve_requests_total", endpoint="chat", status="timeout") == 3
    finally:
        stop()


def test_a_request_that_finishes_in_time_is_not_cut(tokenizer):
    """The deadline ends only requests that outlive it: one answered at once is a 200, uncounted."""
    cluster = FakeCluster()
    cluster.spec = ClusterSpec(request_timeout_s=TIMEOUT_S)
    url, stop = serve_in_thread(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/v1/chat/completions", json=chat()).status_code == 200
            time.sleep(TIMEOUT_S * 1.5)  # the finished request's timer must not fire into anything
            assert http.post("/v1/chat/completions", json=chat()).status_code == 200
            assert metric(http.get("/metrics").text, "pdserve_request_deadline_exceeded_total", endpoint="chat") == 0
    finally:
        stop()


def test_a_non_streaming_client_that_leaves_aborts_its_request(tokenizer):
    """A non-streaming request whose tokens keep coming (one every 20 ms): its client closes the
    connection after 0.5 s, and the request is aborted on the cluster, so the decode instance
    frees its blocks (measured: within milliseconds; allowed: 10 s)."""
    cluster = TricklingCluster()
    url, stop = serve_in_thread(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    try:
        address = urlparse(url)
        body = json.dumps({"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 100}).encode()
        with socket.create_connection((address.hostname, address.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: cluster.submitted, "the request never reached the cluster")
            time.sleep(0.5)  # tokens are flowing
        rid = cluster.submitted[0][0]
        wait_for(lambda: rid in cluster.aborted, "the request of a client that left was not aborted")
    finally:
        stop()
