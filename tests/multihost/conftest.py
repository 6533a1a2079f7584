"""Fixtures of the multi-host suite: one test bed (`bench.multihost.Bed`: network and PID
namespaces, a real Ray node per host, a real redis-server) shared by every test of tests/multihost,
and the Helm chart's pods (`bench.chart_pods.ChartPods`) on a bed of their own.

Skipped without root, iproute2, util-linux or redis-server; with PDSERVE_REQUIRE_MULTIHOST=1
(`.ci/run` sets it) a missing prerequisite fails instead, so CI cannot pass by skipping.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.chart_pods import BED_AUTH
from bench.multihost import Bed, HostSpec
from bench.multihost_serving import serve_on_bed, stop_process

BIN = Path(sys.executable).parent  # the venv's bin: ray, pdserve
logger = logging.getLogger(__name__)
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
    from engine.core.request import SamplingParams
    llm = LLM(model="smollm2", dtype="float32", num_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


class ChartDeployment:
    """The chart's pods (`bench.chart_pods.BED_VALUES`) on a bed of their own, checked before each
    module that uses them: pods that exited are restarted, and a deployment still not at its spec
    after `repair_s` is rebuilt, so one module's failure cannot fail the modules after it."""

    def __init__(self, bed: Bed):
        self.bed, self.pods = bed, None

    def build(self) -> None:
        from bench.chart_pods import BED_VALUES, ChartPods
        self.pods = ChartPods(self.bed, BED_VALUES, release="pd").up(timeout=300)

    def why_not_at_spec(self) -> str | None:
        """None when every pod runs, the controller has one healthy prefill and one healthy decode
        instance, and each of the two gateways is ready and sees exactly those; else what is not."""
        pods = self.pods
        if stopped := [n for n in pods.pods if not pods.running(n)]:
            return f"pods not running: {stopped}"
        (ctl,) = [n for n, c in pods.pods.items() if c == "controller"]
        gateways = [n for n, c in pods.pods.items() if c == "gateway"]
        try:
            status = httpx.get(pods.url(ctl) + "/status", timeout=10).json()["instances"]
            healthy = {i["instance_id"]: i["role"] for i in status if i["healthy"] and not i["draining"]}
            if sorted(healthy.values()) != ["decode", "prefill"]:
                return f"controller's healthy instances: {healthy}"
            for gw in gateways:
                url = pods.url(gw)
                answer = httpx.get(url + "/status", headers=BED_AUTH, timeout=10)
                seen = {i["instance_id"] for i in answer.json()["instances"] if i["healthy"]}
                if httpx.get(url + "/ready", timeout=10).status_code != 200 or seen != set(healthy):
                    return f"gateway {gw} not ready or sees {sorted(seen)}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if len(gateways) == 2 else f"{len(gateways)} gateway pods"

    def ensure(self, repair_s: float = 180.0) -> None:
        """At spec, else repaired within `repair_s` (exited pods restarted), else rebuilt."""
        from bench.chaos_faults import Kubelet
        kubelet, deadline = Kubelet(self.pods, delay_s=0.0), time.monotonic() + repair_s
        while (why := self.why_not_at_spec()) is not None and time.monotonic() < deadline:
            kubelet.tick()
            time.sleep(2.0)
        if why is not None:
            logger.warning("the chart's pods are not at spec after %.0f s (%s): rebuilding them", repair_s, why)
            self.pods.down()
            self.build()


@pytest.fixture(scope="package")
def chart_deployment():
    """The package's one ChartDeployment, built once; its bed has no Ray of the `bed` fixture's
    (the chart's head is the Ray cluster)."""
    skip_unless_bed_can_run()
    bed = Bed([]).up()
    deployment = ChartDeployment(bed)
    try:
        deployment.build()
        yield deployment
    finally:
        if deployment.pods is not None:
            deployment.pods.down()
        bed.down()


@pytest.fixture(scope="module")
def chart(chart_deployment):
    """The chart's pods (SmolLM2 fp32, 1 prefill + 1 decode, Redis, 2 gateways), every pod running
    and ready, at spec when the module starts (ChartDeployment.ensure). Tests that break a pod
    restore it."""
    chart_deployment.ensure()
    return chart_deployment.pods
