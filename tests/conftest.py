"""Fixtures shared by the whole suite."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


@pytest.fixture
def spans():
    """Tracing on in this process (engine/core/tracing.py), every service's spans to an in-memory exporter
    (returned); off again afterwards."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.core import tracing
    exporter = InMemorySpanExporter()
    tracing.configure(tracing.TracingConfig("http://127.0.0.1:4318"), exporter)
    yield exporter
    tracing.configure(None)


@pytest.fixture(autouse=True, scope="session")
def _linear_kernels_cache(tmp_path_factory):
    """int8 kernel measurements go to a session-private cache, never the user's ~/.cache (child
    processes and Ray actors inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_LINEAR_KERNELS_CACHE", str(tmp_path_factory.mktemp("linear_kernels") / "kernels.json"))
        yield


@pytest.fixture(autouse=True, scope="session")
def _prepared_layers_cache(tmp_path_factory):
    """Prepared linear layers (engine/quant/prepared.py) are cached in a session-private folder, never
    the user's ~/.cache: a test's checkpoints live in its own temporary folder, new every session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_PREPARED_CACHE_DIR", str(tmp_path_factory.mktemp("prepared_layers")))
        yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(binary: str, workdir) -> tuple[subprocess.Popen, int]:
    """Starts redis-server on a free loopback port and waits until it answers PING."""
    import redis

    for _ in range(3):  # the free port may be taken between probing and binding: retry
        port = _free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir)],
                                cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.ping():
                    client.close()
                    return proc, port
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        proc.kill()
        proc.wait()
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """URL of a private redis-server for this test session (killed at the end). Skips only
    when the `redis-server` binary is missing; `.ci/run` installs it, so CI never skips."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    proc, port = _start_redis(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL past 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
