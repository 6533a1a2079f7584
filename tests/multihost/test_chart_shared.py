"""The Helm chart with `workerPods: shared` on a bed of its own: one worker Deployment whose pods carry the
`worker` Ray resource, the controller placing its prefill and its decode instance on two of them, and
the release serving equal to the colocated engine through its gateway. (The flip itself on pods holding
`worker`: tests/cluster/control/test_ray_cluster.py; the autoscaler's pod marks and scale:
tests/cluster/autoscale/test_kubernetes_pods.py.)"""
from __future__ import annotations

import httpx
import pytest

from bench.chart_pods import BED_AUTH, BED_VALUES, ChartPods
from bench.multihost import Bed
from tests.multihost.conftest import PROMPTS, skip_unless_bed_can_run
from tests.multihost.streams import Stream
from tests.multihost.test_gateways import checked

pytestmark = pytest.mark.timeout(600)
SHARED_VALUES = {**BED_VALUES, "workerPods": "shared", "gateway": {**BED_VALUES["gateway"], "replicas": 1}}


@pytest.fixture(scope="module")
def shared_chart():
    skip_unless_bed_can_run()
    bed = Bed([]).up()
    pods = None
    try:
        pods = ChartPods(bed, SHARED_VALUES, release="pds").up(timeout=300)
        yield pods
    finally:
        if pods is not None:
            pods.down()
        bed.down()


def test_both_roles_run_on_shared_worker_pods_and_serve(shared_chart, reference):
    """Two `worker` pods (no prefill or decode Deployment); the controller's prefill and decode instances
    each on one of them, every rank at its pod's address; four greedy streams through the gateway equal
    the colocated engine's text."""
    pods = shared_chart
    workers = sorted(n for n, c in pods.pods.items() if c == "worker")
    assert len(workers) == 2 and not {"prefill", "decode"} & set(pods.pods.values())
    (ctl,) = [n for n, c in pods.pods.items() if c == "controller"]
    instances = httpx.get(f"{pods.url(ctl)}/status", timeout=10).json()["instances"]
    assert sorted(i["role"] for i in instances) == ["decode", "prefill"]
    at = {i["role"]: {r["node_ip"] for r in i["ranks"]} for i in instances}
    assert {ip for ips in at.values() for ip in ips} == {pods.address(w) for w in workers}, at
    (gateway,) = [n for n, c in pods.pods.items() if c == "gateway"]
    assert httpx.get(f"{pods.url(gateway)}/ready", headers=BED_AUTH, timeout=10).status_code == 200
    for stream in [Stream(pods.url(gateway), p) for p in PROMPTS[:4]]:
        checked(stream, reference)
