"""The Kubernetes actuator's pods (cluster/autoscale/kubernetes_pods.py): each worker pod marked with the role
it serves, a scale-down that takes the pods with no instance and never one that serves, and shared worker
pods (spec worker_pods shared) on which instances flip while the one Deployment follows the pools' sum.
The real `kubernetes` client against fake_kube.py, whose scale-down deletes pods as a ReplicaSet does."""
from __future__ import annotations

import logging

import pytest
from kubernetes import client

from cluster.autoscale.actuators import PodsThenInstances, PoolSizes, RayActuator
from cluster.autoscale.kubernetes_actuator import KubernetesActuator
from cluster.autoscale.kubernetes_pods import DELETION_COST_ANNOTATION, ROLE_ANNOTATION, placed_roles
from router.client import InstanceInfo, InstanceLoad
from tests.cluster.autoscale.fake_kube import NS, FakeKubeAPI, serve

pytestmark = pytest.mark.timeout(60)


class PodCluster:
    """A stand-in cluster whose instances sit on the fake API's pods (one each, by address): what the
    RayActuator asks of a Controller, and its instance_status rows."""

    def __init__(self, api: FakeKubeAPI, roles: dict[str, str]):
        self.api, self.calls = api, []
        self.at: dict[str, str] = {}  # instance id -> pod address
        self.infos: dict[str, InstanceInfo] = {}
        for ip, role in roles.items():
            self._place(f"{role}-{ip}", role, ip)

    def _place(self, iid: str, role: str, ip: str) -> None:
        self.at[iid] = ip
        self.infos[iid] = InstanceInfo(iid, role, 1, load=InstanceLoad.of({"running": 0, "queued_prefill_tokens": 0}))

    def instance_infos(self) -> list[InstanceInfo]:
        return list(self.infos.values())

    def instance_status(self) -> list[dict]:
        return [{"instance_id": iid, "role": i.role, "draining": False, "ranks": [{"rank": 0, "node_ip": self.at[iid]}]}
                for iid, i in self.infos.items()]

    def flip_instance(self, iid: str, role: str, timeout_s: float) -> dict[str, float]:
        self.calls.append(("flip", iid, role))
        self.infos[iid].role = role
        return {"drain_s": 0.0, "rebuild_s": 0.1, "total_s": 0.1}

    def add_instance(self, role: str) -> str:
        """On a pod no instance holds (it must exist: its Deployment grew first)."""
        free = [p.ip for p in self.api.pods.values() if p.ip not in self.at.values()]
        assert free, "an instance added before its pod"
        iid = f"{role}-{free[0]}"
        self._place(iid, role, free[0])
        self.calls.append(("add", role))
        return iid

    def drain_instance(self, iid: str, timeout_s: float) -> bool:
        self.calls.append(("drain", iid))
        self.api.timeline.append(("drain", iid))
        del self.infos[iid], self.at[iid]
        return True


def actuator(host: str, deployments: dict, cluster: PodCluster | None = None) -> KubernetesActuator:
    placed = None if cluster is None else (lambda: placed_roles(cluster.instance_status()))
    return KubernetesActuator(deployments, NS, client.ApiClient(client.Configuration(host=host)), placed=placed)


def marks_of(api: FakeKubeAPI, deployment: str) -> dict[str, str]:
    return {p.ip: p.annotations.get(ROLE_ANNOTATION) for p in api.pods_of(deployment)}


@pytest.fixture
def per_role(monkeypatch):
    """pd-prefill with 1 pod, pd-decode with 3 (10.0.0.2-4); yields (api, host)."""
    api = FakeKubeAPI({(NS, "pd-prefill"): 1, (NS, "pd-decode"): 3}, with_pods=True)
    for host in serve(api, monkeypatch):
        yield api, host


@pytest.fixture
def shared(monkeypatch):
    """One pd-worker Deployment of 4 pods (10.0.0.1-4); yields (api, host)."""
    api = FakeKubeAPI({(NS, "pd-worker"): 4}, with_pods=True)
    for host in serve(api, monkeypatch):
        yield api, host


def test_a_scale_down_takes_the_drained_pod_not_the_newest(per_role):
    """Decode shrinks 3 -> 2 after its instance on the oldest decode pod drained: that pod is marked
    idle with the lowest deletion cost before the replicas drop, so the ReplicaSet deletes it; without
    the marks it would have deleted the newest, which serves."""
    api, host = per_role
    cluster = PodCluster(api, {"10.0.0.1": "prefill", "10.0.0.2": "decode", "10.0.0.3": "decode",
                               "10.0.0.4": "decode"})
    both = PodsThenInstances(actuator(host, {"prefill": "pd-prefill", "decode": "pd-decode"}, cluster),
                             RayActuator(cluster, flips=False))
    cluster.infos["decode-10.0.0.3"].load = InstanceLoad.of({"running": 5})
    cluster.infos["decode-10.0.0.4"].load = InstanceLoad.of({"running": 5})  # 10.0.0.2: the least loaded
    both.apply(PoolSizes(1, 2))
    assert cluster.calls == [("drain", "decode-10.0.0.2")]
    assert api.deleted == ["pd-decode-2"] and api.replicas[(NS, "pd-decode")] == 2
    assert api.timeline.index(("ANNOTATE", "pd-decode-2")) < api.timeline.index(("PATCH", "pd-decode"))
    assert marks_of(api, "pd-decode") == {"10.0.0.3": "decode", "10.0.0.4": "decode"}
    assert all(p.annotations[DELETION_COST_ANNOTATION] == "0" for p in api.pods_of("pd-decode"))


def test_a_scale_down_never_takes_a_pod_that_serves(per_role, caplog):
    """Asked to drop two decode pods while only one hosts no instance, the Deployment drops one, and says so."""
    api, host = per_role
    cluster = PodCluster(api, {"10.0.0.1": "prefill", "10.0.0.3": "decode", "10.0.0.4": "decode"})
    pods = actuator(host, {"prefill": "pd-prefill", "decode": "pd-decode"}, cluster)
    with caplog.at_level(logging.WARNING, logger="cluster.autoscale.kubernetes_actuator"):
        pods.shrink(PoolSizes(1, 1))
    assert api.deleted == ["pd-decode-2"] and api.replicas[(NS, "pd-decode")] == 2
    assert any("only 1 of its pods host no instance" in r.getMessage() for r in caplog.records)


def test_shared_pods_flip_in_place_and_carry_their_role(shared):
    """2P2D -> 1P3D on shared worker pods: one prefill instance flips, no pod is added or deleted, and
    the flipped pod's role mark follows; current() counts the marks."""
    api, host = shared
    cluster = PodCluster(api, {"10.0.0.1": "prefill", "10.0.0.2": "prefill", "10.0.0.3": "decode",
                               "10.0.0.4": "decode"})
    pods = actuator(host, {"worker": "pd-worker"}, cluster)
    PodsThenInstances(pods, RayActuator(cluster)).apply(PoolSizes(1, 3))
    assert cluster.calls == [("flip", "prefill-10.0.0.1", "decode")]
    assert api.patches() == [] and api.deleted == []
    assert sorted(marks_of(api, "pd-worker").values()) == ["decode", "decode", "decode", "prefill"]
    assert pods.current() == PoolSizes(1, 3)


def test_shared_pods_grow_before_an_add_and_shrink_by_the_drained_pod(shared):
    """The one Deployment follows the pools' sum: 2P2D -> 2P3D adds a pod first, then the instance on it;
    -> 2P1D drains two decode instances, then the Deployment drops their two pods and no other."""
    api, host = shared
    cluster = PodCluster(api, {"10.0.0.1": "prefill", "10.0.0.2": "prefill", "10.0.0.3": "decode",
                               "10.0.0.4": "decode"})
    both = PodsThenInstances(actuator(host, {"worker": "pd-worker"}, cluster), RayActuator(cluster))
    both.apply(PoolSizes(2, 3))
    assert api.replicas[(NS, "pd-worker")] == 5 and cluster.calls == [("add", "decode")]
    assert marks_of(api, "pd-worker")["10.0.0.5"] == "decode"
    cluster.infos["decode-10.0.0.4"].load = InstanceLoad.of({"running": 9})
    both.apply(PoolSizes(2, 1))
    drained = {iid.split("-", 1)[1] for _, iid in cluster.calls[1:]}
    assert drained == {"10.0.0.3", "10.0.0.5"} and api.replicas[(NS, "pd-worker")] == 3
    assert {p.ip for p in api.pods.values()} == {"10.0.0.1", "10.0.0.2", "10.0.0.4"}


def test_deployments_are_per_role_or_one_shared():
    with pytest.raises(ValueError, match="prefill and decode, or worker"):
        KubernetesActuator({"prefill": "a"}, NS, client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
