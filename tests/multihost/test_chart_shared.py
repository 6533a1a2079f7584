"""The Helm chart with `workerPods: shared` and the autoscaler on, on a bed of its own with a Kubernetes API
(bench/bed_kube_api.py: scale and pods, as the rendered Role allows): three `worker` pods for 2 prefill
and 1 decode instances, a fixed fleet (`max_instances` 3) and the queue policy. Under a decode-bound load
the autoscaler flips a prefill instance to decode in place, with no pod added or deleted and every stream
equal to the colocated engine; once the load stops, decode shrinks and the Deployment deletes the drained
instance's pod, never one that serves. Each pod's `pdserve.io/role` follows what it serves."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from bench.bed_kube_api import BedKubeAPI
from bench.chart_pods import BED_AUTH, BED_VALUES, ChartPods
from bench.multihost import Bed
from tests.multihost.conftest import PROMPTS, skip_unless_bed_can_run
from tests.multihost.streams import Stream
from tests.multihost.test_gateways import checked, wait_until

pytestmark = pytest.mark.timeout(600)
QUIET_S = 45  # scale_down_cooldown_s: the load starts well within it, so the first shrink is a flip
FLIP_VALUES = {
    **BED_VALUES, "workerPods": "shared", "prefill": {"replicas": 2}, "decode": {"replicas": 1},
    "gateway": {**BED_VALUES["gateway"], "replicas": 1},
    "autoscaler": {"enabled": True, "policy": "queue", "minPrefill": 1, "maxPrefill": 2, "minDecode": 1,
                   "maxDecode": 2},
    # decode-bound: two sequences per instance, so a few streams keep requests waiting for decode
    "spec": {**BED_VALUES["spec"], "max_num_seqs": 2, "max_instances": 3, "autoscale_interval_s": 1,
             "scale_up_cooldown_s": 1, "scale_down_cooldown_s": QUIET_S},
}


@pytest.fixture(scope="module")
def cluster():
    """(ChartPods, BedKubeAPI) of the release, up."""
    skip_unless_bed_can_run()
    bed = Bed([]).up()
    pods = ChartPods(bed, FLIP_VALUES, release="pdf")
    api = BedKubeAPI(pods).start()
    try:
        pods.up(timeout=300)
        yield pods, api
    finally:
        pods.down()
        api.stop()
        bed.down()


def one(pods, component: str) -> str:
    (name,) = [n for n, c in pods.pods.items() if c == component]
    return name


def placed(pods) -> dict[str, str]:
    """{instance id: role} of the controller's serving instances (healthy, not draining)."""
    rows = httpx.get(f"{pods.url(one(pods, 'controller'))}/status", timeout=10).json()["instances"]
    return {i["instance_id"]: i["role"] for i in rows if i["healthy"] and not i["draining"]}


def pod_roles(pods, api) -> dict[str, str]:
    """{worker pod: its role annotation} (absent: "")."""
    return {n: api.annotations(n).get("pdserve.io/role", "") for n, c in pods.pods.items() if c == "worker"}


def serving_pods(pods) -> dict[str, str]:
    """{worker pod: the role of the instance on it}, from the ranks' addresses."""
    by_ip = {pods.address(n): n for n, c in pods.pods.items() if c == "worker"}
    rows = httpx.get(f"{pods.url(one(pods, 'controller'))}/status", timeout=10).json()["instances"]
    return {by_ip[r["node_ip"]]: i["role"] for i in rows for r in i["ranks"]}


def test_a_decode_bound_load_flips_a_prefill_instance_in_place(cluster, reference):
    """2P1D on three worker pods, 8 clients streaming: the autoscaler flips a prefill instance to decode
    (same id, same pod), adds and deletes no pod; every stream equals the colocated engine's text; the
    pods' role marks follow."""
    pods, api = cluster
    before = placed(pods)
    assert sorted(before.values()) == ["decode", "prefill", "prefill"]
    assert sorted(c for c in pods.pods.values() if c == "worker") == ["worker"] * 3
    stop, streams = threading.Event(), []

    def client(i: int) -> None:
        while not stop.is_set():
            streams.append(Stream(pods.url(one(pods, "gateway")), PROMPTS[i % len(PROMPTS)]).result(300))
            i += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        after = wait_until(lambda: (p := placed(pods)) and sorted(p.values()) == ["decode", "decode", "prefill"]
                           and p, 3 * QUIET_S + 60, "a prefill instance flipped to decode")
        time.sleep(3)  # streams on the flipped instance
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert set(after) == set(before)  # the same instances: one changed role, none added
    (flipped,) = [i for i in after if before[i] != after[i]]
    assert before[flipped] == "prefill"
    assert len(streams) > 8
    for stream in streams:
        checked(stream, reference)
    assert api.scale_patches == [] and api.pods_deleted == [] and api.forbidden == []
    wait_until(lambda: pod_roles(pods, api) == serving_pods(pods), 30, "the pods' role marks")


def test_an_idle_decode_instance_leaves_with_its_pod(cluster):
    """No load: decode shrinks 2 -> 1 after the quiet time; the worker Deployment goes 3 -> 2 and the pod
    deleted is the drained instance's; every pod left serves, marked with its role."""
    pods, api = cluster
    wait_until(lambda: api.pods_deleted, 3 * QUIET_S + 60, "a worker pod deleted")
    (deleted,) = api.pods_deleted
    assert api.deleted_annotations[deleted] == {"pdserve.io/role": "idle",
                                                "controller.kubernetes.io/pod-deletion-cost": "-100"}
    assert api.scale_patches == [("pdf-pdserve-worker", 2)] and api.forbidden == []
    left = placed(pods)
    assert sorted(left.values()) == ["decode", "prefill"]
    assert deleted not in pods.pods and len(serving_pods(pods)) == 2 == len(pod_roles(pods, api))
    assert pod_roles(pods, api) == serving_pods(pods)
    assert httpx.get(f"{pods.url(one(pods, 'gateway'))}/ready", headers=BED_AUTH, timeout=10).status_code == 200
