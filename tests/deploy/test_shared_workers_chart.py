"""The chart with `workerPods: shared`: one worker Deployment whose pods serve either role (so the autoscaler
flips instances in place: docs/autoscaling.md), sized to both pools, its pods' Ray resource the one the
loaded spec's ranks ask for; RBAC, disruption budget and network policy follow; a pod shape or TP size
that differs between the pools is refused at render."""
from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest

from cluster.control.rank_planner import RankPlanner
from tests.deploy.test_helm import NAMESPACE, container, find, loaded_spec, manifests, one, render

pytestmark = pytest.mark.timeout(300)
SHARED = {"workerPods": "shared", "autoscaler": {"enabled": True}, "decode": {"replicas": 2}}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return manifests(SHARED)


def test_one_worker_deployment_sized_to_both_pools(objects):
    """pdserve-worker with prefill.replicas + decode.replicas pods and no per-role Deployments; each pod a
    Ray node with one `worker` unit per rank; every object valid for Kubernetes (strict)."""
    deployments = {d["metadata"]["name"]: d for d in find(objects, "Deployment")}
    assert "pdserve-worker" in deployments and not {"pdserve-prefill", "pdserve-decode"} & set(deployments)
    worker = deployments["pdserve-worker"]
    assert worker["spec"]["replicas"] == 1 + 2
    assert worker["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    resources = next(a for a in container(worker)["command"] if a.startswith("--resources="))
    assert json.loads(resources.removeprefix("--resources=")) == {"worker": 1}
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_spec_places_both_roles_on_the_worker_pods(objects):
    """The spec the controller loads runs shared worker pods, names the worker Deployment, and asks for each
    rank of either role exactly the Ray resource the worker pods carry."""
    spec = loaded_spec(objects)
    assert spec.worker_pods == "shared" and spec.ray_resources and spec.autoscale_actuator == "kubernetes"
    assert spec.k8s_worker_deployment == "pdserve-worker" and spec.k8s_namespace == NAMESPACE
    assert (spec.num_prefill, spec.num_decode) == (1, 2)
    carried = container(one(objects, "Deployment", "pdserve-worker"))["command"]
    carried = set(json.loads(next(a for a in carried if a.startswith("--resources=")).split("=", 1)[1]))
    for role in ("prefill", "decode"):
        custom = set(RankPlanner(spec, multihost=True).rank_resources(role, gpu=False)) - {"CPU"}
        assert custom == carried, role


def test_rbac_budget_and_policy_follow_the_worker_deployment(objects):
    """The autoscaler's Role scales only pdserve-worker (and lists and annotates pods); the disruption budget
    and the network policy select the worker pods."""
    (role,) = find(objects, "Role")
    assert role["rules"][0]["resourceNames"] == ["pdserve-worker"]
    assert role["rules"][1] == {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        names = {o["metadata"]["name"] for o in find(objects, kind)}
        assert "pdserve-worker" in names and not {"pdserve-prefill", "pdserve-decode"} & names, kind
    pdb = one(objects, "PodDisruptionBudget", "pdserve-worker")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"


@pytest.mark.parametrize("bad, message", [
    ({"decode": {"replicas": 2, "cpus": 4}}, r"prefill.cpus \(2\) differs from decode.cpus \(4\)"),
    ({"prefill": {"replicas": 1, "gpu": 1}}, "prefill.gpu"),
    ({"spec": {"prefill_tp": 2}}, r"spec.prefill_tp \(2\) and spec.decode_tp \(1\) must be equal"),
])
def test_pools_that_differ_are_refused(bad, message):
    with pytest.raises(helm.HelmError, match=message):
        render({**SHARED, **bad})


def test_per_role_is_the_default():
    """Without workerPods the chart keeps the prefill and decode Deployments, and the spec says per_role."""
    objects = manifests()
    assert {"pdserve-prefill", "pdserve-decode"} <= {d["metadata"]["name"] for d in find(objects, "Deployment")}
    assert loaded_spec(objects).worker_pods == "per_role"
