"""SIGTERM to a real gateway process (cluster/cli/serve.py `run_server`, as `pdserve gateway` and
`pdserve serve` run it) 2 s into its streams, over a cluster that streams one token per 0.1 s
(tests/gateway/test_drain.py SlowCluster): each stream either finishes with [DONE] or ends with an
error chunk that openai-python raises, never cut; the process exits once they ended."""
from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.gateway.test_drain import SlowCluster, chat, read_stream

pytestmark = pytest.mark.timeout(420)
START_TIMEOUT_S = 300  # imports and the tokenizer: 25 s measured on a loaded 2-core box


def serve_slow(port: int, drain_timeout_s: float) -> None:
    """The server process: a gateway over a SlowCluster on 127.0.0.1:port; prints each abort."""
    from cluster.cli.serve import run_server
    from cluster.spec import ClusterSpec
    from engine.loading.loader import resolve_model_path
    from engine.text.tokenizer import Tokenizer
    from gateway.app import create_app
    logging.basicConfig(level=logging.INFO)
    cluster = SlowCluster(on_abort=lambda rid: print(f"aborted {rid}", flush=True))
    app = create_app(cluster, Tokenizer.from_path(resolve_model_path("smollm2")), "smollm2", None)
    sys.exit(run_server(app, ClusterSpec(host="127.0.0.1", port=port, drain_timeout_s=drain_timeout_s), "info",
                        drain=True))


def start(drain_timeout_s: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"from tests.cluster.cli.test_serve_drain import serve_slow; serve_slow({port}, {drain_timeout_s})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"the gateway did not start: {proc.communicate()[0][-3000:]}")


def openai_stream(url: str, errors: list) -> None:
    """A 30 s stream read by openai-python; appends what it raised (nothing: None)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        for _ in client.chat.completions.create(**chat(300, True)):
            pass
        errors.append(None)
    except openai.APIError as exc:
        errors.append(exc)


def test_sigterm_2s_into_a_30s_stream_ends_it_with_an_error_chunk_at_the_bound():
    """Drain bound 3 s. SIGTERM 2 s after a 30 s stream's first token: the stream ends with the
    error chunk and [DONE] (its tokens before them), openai-python raises APIError with code
    server_shutting_down for a second one, the generations are aborted, and the process exits."""
    proc, url = start(3.0)
    first, lines, errors = threading.Event(), [], []
    readers = [threading.Thread(target=read_stream, args=(url, chat(300, True), first, lines)),
               threading.Thread(target=openai_stream, args=(url, errors))]
    for reader in readers:
        reader.start()
    assert first.wait(60)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(120)
    output = proc.communicate(timeout=120)[0]
    assert lines[-1] == "[DONE]", lines[-3:]
    assert json.loads(lines[-2])["error"]["code"] == "server_shutting_down"
    assert sum('"content": "' in line for line in lines) > 10  # the tokens of the first 2 s came first
    (error,) = errors
    assert isinstance(error, openai.APIError) and error.code == "server_shutting_down", error
    assert output.count("aborted chatcmpl-") == 2, output[-3000:]


def test_sigterm_2s_into_a_10s_stream_lets_it_finish_within_the_bound():
    """Drain bound 120 s. SIGTERM 2 s into a 10 s stream (which uvicorn's old 5 s graceful
    shutdown cut): every token, finish_reason length and [DONE] arrive; then the process exits,
    long before the bound."""
    proc, url = start(120.0)
    first, lines = threading.Event(), []
    reader = threading.Thread(target=read_stream, args=(url, chat(100, True), first, lines))
    reader.start()
    assert first.wait(60)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    reader.join(120)
    signalled = time.monotonic()
    proc.communicate(timeout=120)
    assert time.monotonic() - signalled < 60  # it did not wait for the bound once the stream ended
    assert lines[-1] == "[DONE]" and not any('"error"' in line for line in lines)
    chunks = [json.loads(line) for line in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 100
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
