"""The gateway's drain (gateway/drain.py) in process, over a cluster that streams one token per
0.1 s: what runs when the drain begins finishes if it can within the bound, and otherwise ends with
an error chunk and [DONE] (a stream) or a 503 (not started); nothing new gets in, readiness fails
at once, liveness does not; a cut request is aborted on the cluster and frees its key's slot.
The real process on SIGTERM: tests/cluster/cli/test_serve_drain.py."""
from __future__ import annotations

import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from cluster.cli.serve import serve_in_thread
from gateway.api_keys import APIKey, hash_api_key
from gateway.app import create_app
from gateway.drain import ERROR_CODE, Drain
from router.tables import StreamEvent
from tests.gateway.fakes import TOKENS, FakeCluster

pytestmark = pytest.mark.timeout(120)
KEY = "sk-drain-test-5c1e9a7b3d"
AUTH = {"Authorization": f"Bearer {KEY}"}


class SlowCluster(FakeCluster):
    """One token per `interval_s` per request (one choice), up to max_tokens; an abort stops it."""

    max_model_len = 4096

    def __init__(self, interval_s: float = 0.1, on_abort=None):
        super().__init__()
        self.interval_s, self.on_abort = interval_s, on_abort

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.submitted.append((request_id, prompt_token_ids, params))

        def emit():
            for i in range(params.max_tokens):
                time.sleep(self.interval_s)
                if request_id in self.aborted:
                    return
                listener(StreamEvent([TOKENS[i % len(TOKENS)]]))
            listener(StreamEvent([], True, "length"))
        threading.Thread(target=emit, daemon=True).start()

    def abort(self, request_id):
        super().abort(request_id)
        if self.on_abort is not None:
            self.on_abort(request_id)


def chat(max_tokens: int, stream: bool) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens,
            "stream": stream}


def read_stream(url: str, body: dict, first: threading.Event, lines: list[str], headers=None) -> None:
    """Appends the stream's `data:` payloads to `lines`; sets `first` at the first content chunk."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line.removeprefix("data: "))
                if '"content": "' in line and '"content": ""' not in line:
                    first.set()


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    (line,) = [ln for ln in text.splitlines() if ln.startswith('pdserve_api_key_in_flight_requests{key="team"}')]
    return float(line.split()[-1])


@pytest.fixture
def served(tokenizer):
    """(cluster, drain, url) for a drain bound the test sets with `make(bound_s)`."""
    stops = []

    def make(bound_s: float):
        cluster = SlowCluster()
        keys = [APIKey("team", hash_api_key(KEY), max_concurrent=4)]
        drain = Drain(create_app(cluster, tokenizer, "smollm2", None, api_keys=keys), bound_s)
        url, stop = serve_in_thread(drain)
        stops.append(stop)
        return cluster, drain, url
    yield make
    for stop in stops:
        stop()


def test_past_the_bound_a_stream_ends_with_an_error_chunk_and_a_waiting_request_with_503(served):
    """A 30 s stream and a non-streaming 30 s request, running when the drain begins with a 1 s
    bound: the stream's last two events are an error (code server_shutting_down) and [DONE], after
    the tokens it had; the other request gets a 503 with the OpenAI body. Meanwhile /ready and new
    /v1 requests get 503 and /health 200. Both are aborted on the cluster and their slots freed."""
    cluster, drain, url = served(1.0)
    first, lines, answers = threading.Event(), [], []
    streaming = threading.Thread(target=read_stream, args=(url, chat(300, True), first, lines, AUTH))
    waiting = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{url}/v1/chat/completions", json=chat(300, False), headers=AUTH, timeout=120)))
    streaming.start(), waiting.start()
    assert first.wait(60)
    drain.begin()
    began = time.monotonic()
    ready, new = httpx.get(f"{url}/ready"), httpx.post(f"{url}/v1/chat/completions", json=chat(5, True), headers=AUTH)
    assert ready.status_code == 503 and new.status_code == 503 and new.json()["error"]["code"] == ERROR_CODE
    assert httpx.get(f"{url}/health").status_code == 200
    streaming.join(60), waiting.join(60)
    assert time.monotonic() - began < 25  # cut by the bound, long before the 30 s of tokens ran out
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == ERROR_CODE and error["type"] == "service_unavailable"
    assert any('"content": "The"' in line for line in lines[:-2])
    (answer,) = answers
    assert answer.status_code == 503 and answer.json()["error"]["code"] == ERROR_CODE
    deadline = time.monotonic() + 30
    while len(cluster.aborted) < 2 and time.monotonic() < deadline:  # aborts run on a worker thread
        time.sleep(0.05)
    assert sorted(cluster.aborted) == sorted(rid for rid, _, _ in cluster.submitted)
    assert in_flight(url) == 0


def test_within_the_bound_a_stream_finishes_untouched(served):
    """A 2 s stream running when a drain with a 30 s bound begins ends as it would have: every
    token, finish_reason length, [DONE], and no error."""
    cluster, drain, url = served(30.0)
    first, lines = threading.Event(), []
    streaming = threading.Thread(target=read_stream, args=(url, chat(20, True), first, lines, AUTH))
    streaming.start()
    assert first.wait(60)
    drain.begin()
    streaming.join(60)
    assert lines[-1] == "[DONE]" and not any('"error"' in line for line in lines)
    chunks = [json.loads(line) for line in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 20
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert cluster.aborted == []


def test_a_zero_bound_ends_running_streams_at_once(served):
    """drain_timeout_s 0: a running stream ends with the error chunk right away (well before its
    next 30 s of tokens), and a drain begun twice is begun once."""
    _, drain, url = served(0.0)
    first, lines = threading.Event(), []
    streaming = threading.Thread(target=read_stream, args=(url, chat(300, True), first, lines, AUTH))
    streaming.start()
    assert first.wait(60)
    drain.begin()
    began_s = drain.began_s
    drain.begin()
    streaming.join(60)
    assert drain.began_s == began_s
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == ERROR_CODE


def test_signals_begin_the_drain_and_a_second_ctrl_c_ends_it_at_once(served):
    """Attached to a server, SIGTERM begins the drain (and still reaches the server's own handler);
    a second SIGINT ends the streams left at once, though the bound is 60 s."""
    _, drain, url = served(60.0)
    seen = []
    server = SimpleNamespace(handle_exit=lambda sig, frame: seen.append(sig))
    drain.attach(server)
    first, lines = threading.Event(), []
    streaming = threading.Thread(target=read_stream, args=(url, chat(300, True), first, lines, AUTH))
    streaming.start()
    assert first.wait(60)
    server.handle_exit(signal.SIGTERM, None)
    assert drain.draining and httpx.get(f"{url}/ready").status_code == 503
    time.sleep(0.5)
    assert streaming.is_alive()  # the bound is 60 s: it goes on
    server.handle_exit(signal.SIGINT, None)
    streaming.join(20)
    assert not streaming.is_alive() and seen == [signal.SIGTERM, signal.SIGINT]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == ERROR_CODE
