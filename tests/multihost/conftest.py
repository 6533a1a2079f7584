"""Fixtures of the multi-host suite: one test bed (`bench.multihost.Bed`: network and PID
namespaces, a real Ray node per host, a real redis-server) shared by every test of tests/multihost.

Skipped without root, iproute2, util-linux or redis-server; with PDSERVE_REQUIRE_MULTIHOST=1
(`.ci/run` sets it) a missing prerequisite fails instead, so CI cannot pass by skipping.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from bench.multihost import Bed, HostSpec
from bench.multihost_serving import serve_on_bed, stop_process

BIN = Path(sys.executable).parent  # the venv's bin: ray, pdserve
HOSTS = [
    HostSpec("head", "head"),
    HostSpec("gw", "gateway"),
    HostSpec("redis", "redis"),
    HostSpec("p1", "prefill", num_cpus=2, resources={"prefill": 2}),
    HostSpec("d1", "decode", num_cpus=3, resources={"decode": 3}),
    HostSpec("d2", "decode", num_cpus=2, resources={"decode": 2}),
]


def missing_prerequisite() -> str | None:
    """Why this machine cannot host a bed, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge)"
    for tool in ("ip", "bridge", "unshare", "nsenter", "redis-server"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (iproute2, util-linux, redis-server)"
    if not (BIN / "ray").exists():
        return f"no `ray` next to {sys.executable}"
    return None


@pytest.fixture(scope="package")
def bed():
    """The bed of this test session: head (0 CPUs), gw (gateway, 0 CPUs), redis, p1 (prefill 2),
    d1 (decode 3), d2 (decode 2), all Ray nodes alive. Tests that break a host restore it.
    NOTE: package scope, i.e. built once for tests/multihost and torn down when its last test
    ends, so its Ray nodes do not idle on a 2-core machine through the rest of the suite."""
    why = missing_prerequisite()
    if why is not None:
        if os.environ.get("PDSERVE_REQUIRE_MULTIHOST") == "1":
            pytest.fail(f"PDSERVE_REQUIRE_MULTIHOST=1 but the multi-host bed cannot run: {why}")
        pytest.skip(why)
    bed = Bed(HOSTS).up()
    try:
        yield bed
    finally:
        bed.down()


def start_serve(bed: Bed, *extra_args: str, port: int = 8000, timeout: float = 300.0):
    """`bench.multihost_serving.serve_on_bed`, failing the test (with the log's tail) instead of raising."""
    try:
        return serve_on_bed(bed, *extra_args, port=port, timeout=timeout)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def serve(bed):
    """Factory: `url = serve(*extra_args)` runs `pdserve serve` on the gateway host (see
    `start_serve`); every server it started is stopped when the test ends."""
    procs = []

    def start(*extra_args: str, port: int = 8000, timeout: float = 300.0) -> str:
        url, proc = start_serve(bed, *extra_args, port=port, timeout=timeout)
        procs.append(proc)
        return url
    yield start
    for proc in procs:
        stop_process(proc)
