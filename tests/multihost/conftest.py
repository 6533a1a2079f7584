"""Fixtures of the multi-host suite: one test bed (`bench.multihost.Bed`: network and PID
namespaces, a real Ray node per host, a real redis-server) shared by every test of tests/multihost,
and the Helm chart's pods (`bench.chart_pods.ChartPods`) on a bed of their own.

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


def skip_unless_bed_can_run() -> None:
    why = missing_prerequisite()
    if why is not None:
        if os.environ.get("PDSERVE_REQUIRE_MULTIHOST") == "1":
            pytest.fail(f"PDSERVE_REQUIRE_MULTIHOST=1 but the multi-host bed cannot run: {why}")
        pytest.skip(why)


@pytest.fixture(scope="package")
def bed():
    """The bed of this test session: head (0 CPUs), gw (gateway, 0 CPUs), redis, p1 (prefill 2),
    d1 (decode 3), d2 (decode 2), all Ray nodes alive. Tests that break a host restore it.
    NOTE: package scope, i.e. built once for tests/multihost and torn down when its last test
    ends, so its Ray nodes do not idle on a 2-core machine through the rest of the suite."""
    skip_unless_bed_can_run()
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


PROMPTS = ["The capital of France is", "Water boils at a temperature of", "One, two, three, four,",
           "The largest planet in the solar system is", "In the morning I like to drink",
           "The quick brown fox", "def fibonacci(n):", "Once upon a time, there was a"]
MAX_TOKENS = 24


@pytest.fixture(scope="package")
def reference() -> dict[str, str]:
    """Greedy colocated outputs of PROMPTS (MAX_TOKENS each; the in-process engine, fp32)."""
    from decode_worker.llm import LLM
    from engine.request import SamplingParams
    llm = LLM(model="smollm2", dtype="float32", num_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="package")
def chart():
    """The chart rendered with `bench.chart_pods.BED_VALUES` (SmolLM2 fp32, 1 prefill + 1 decode,
    Redis, 2 gateways), every pod running and ready, on a bed of its own (no Ray of the bed's:
    the chart's head is the Ray cluster), so this does not need the `bed` fixture's hosts.
    Tests that break a pod restore it. Package scope: one deployment for every test."""
    skip_unless_bed_can_run()
    from bench.chart_pods import BED_VALUES, ChartPods
    bed = Bed([]).up()
    try:
        pods = ChartPods(bed, BED_VALUES, release="pd")
        try:
            yield pods.up(timeout=300)
        finally:
            pods.down()
    finally:
        bed.down()
