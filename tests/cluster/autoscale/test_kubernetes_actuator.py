"""KubernetesActuator with per-role Deployments: the real `kubernetes` client against a fake apps/v1 API
server that implements the deployments/scale subresource (GET and PATCH) on loopback (fake_kube.py).
Pod marks and shared worker pods: test_kubernetes_pods.py."""
from __future__ import annotations

import json
import logging
import socket

import pytest
from kubernetes import client

from cluster.autoscale.actuators import ActuatorError, PoolSizes
from cluster.autoscale.kubernetes_actuator import KubernetesActuator
import cluster.autoscale.kubernetes_actuator as kubernetes_actuator
from tests.cluster.autoscale.fake_kube import MERGE_PATCH_TYPES, NS, SCALE_PATH, FakeKubeAPI, serve

pytestmark = pytest.mark.timeout(60)
DEPLOYMENTS = {"prefill": "pd-prefill", "decode": "pd-decode"}

@pytest.fixture
def fake_api(monkeypatch):
    """Starts a FakeKubeAPI with pd-prefill=1 and pd-decode=1 in namespace "pd", namespace "locked"
    forbidden. Yields (api, host)."""
    api = FakeKubeAPI({(NS, "pd-prefill"): 1, (NS, "pd-decode"): 1,
                       ("locked", "pd-prefill"): 1, ("locked", "pd-decode"): 1},
                      forbidden_namespaces={"locked"})
    for host in serve(api, monkeypatch):
        yield api, host


@pytest.fixture
def api_client(fake_api):
    _, host = fake_api
    api_client = client.ApiClient(client.Configuration(host=host))
    yield api_client
    api_client.close()


def create_actuator(api_client, **knobs) -> KubernetesActuator:
    knobs = {"namespace": NS, **knobs}
    return KubernetesActuator(DEPLOYMENTS, api_client=api_client, **knobs)


def test_current_reads_both_deployments(fake_api, api_client):
    """current() is the spec.replicas of the two Deployments' scale, read with GETs only."""
    api, _ = fake_api
    api.replicas[(NS, "pd-prefill")], api.replicas[(NS, "pd-decode")] = 2, 5
    assert create_actuator(api_client).current() == PoolSizes(prefill=2, decode=5)
    assert [(r.method, r.path) for r in api.requests] == [
        ("GET", SCALE_PATH.format(ns=NS, name="pd-prefill")),
        ("GET", SCALE_PATH.format(ns=NS, name="pd-decode"))]


def test_current_reads_zero_when_replicas_omitted(fake_api, api_client):
    """A Deployment scaled to zero (the API omits spec.replicas) reads as 0, not None."""
    api, _ = fake_api
    api.replicas[(NS, "pd-decode")] = 0
    assert create_actuator(api_client).current() == PoolSizes(prefill=1, decode=0)


def test_apply_patches_only_what_changes(fake_api, api_client):
    """apply(2P3D) from 1P1D sends exactly two merge PATCHes of spec.replicas, which the server
    applies; applying the same sizes again sends no PATCH."""
    api, _ = fake_api
    actuator = create_actuator(api_client)
    actuator.apply(PoolSizes(prefill=2, decode=3))

    patches = api.patches()
    assert [(r.path, r.body) for r in patches] == [
        (SCALE_PATH.format(ns=NS, name="pd-prefill"), {"spec": {"replicas": 2}}),
        (SCALE_PATH.format(ns=NS, name="pd-decode"), {"spec": {"replicas": 3}})]
    assert all(r.content_type in MERGE_PATCH_TYPES for r in patches)
    assert (api.replicas[(NS, "pd-prefill")], api.replicas[(NS, "pd-decode")]) == (2, 3)
    assert actuator.current() == PoolSizes(2, 3)

    actuator.apply(PoolSizes(2, 3))
    assert len(api.patches()) == 2


def test_scale_down_drains_before_patch(fake_api, api_client):
    """A shrinking pool is drained by the number of replicas removed before its PATCH; a growing
    pool is not drained, and it is patched first."""
    api, _ = fake_api
    api.replicas[(NS, "pd-prefill")] = 3
    drain = lambda role, num_remove: api.timeline.append(("drain", role, num_remove))  # noqa: E731
    create_actuator(api_client, drain=drain).apply(PoolSizes(prefill=1, decode=2))
    assert api.timeline == [("PATCH", "pd-decode"), ("drain", "prefill", 2), ("PATCH", "pd-prefill")]
    assert (api.replicas[(NS, "pd-prefill")], api.replicas[(NS, "pd-decode")]) == (1, 2)


def test_failed_drain_patches_nothing(fake_api, api_client):
    """If drain raises, the pool is not scaled down."""
    api, _ = fake_api

    def drain(role, num_remove):
        raise RuntimeError("drain timed out")

    with pytest.raises(RuntimeError, match="drain timed out"):
        create_actuator(api_client, drain=drain).apply(PoolSizes(prefill=0, decode=1))
    assert api.patches() == [] and api.replicas[(NS, "pd-prefill")] == 1


def test_dry_run_logs_and_patches_nothing(fake_api, api_client, caplog):
    """Dry run logs each pool's from -> to change, drains nothing and sends no PATCH."""
    api, _ = fake_api
    drained = []
    actuator = create_actuator(api_client, dry_run=True, drain=lambda *a: drained.append(a))
    with caplog.at_level(logging.INFO, logger="cluster.autoscale.kubernetes_actuator"):
        actuator.apply(PoolSizes(prefill=3, decode=0))
    assert api.patches() == [] and drained == []
    assert actuator.current() == PoolSizes(1, 1)
    messages = [r.getMessage() for r in caplog.records if "dry run" in r.getMessage()]
    assert len(messages) == 2
    assert any("prefill" in m and "pd-prefill" in m and "1 -> 3" in m for m in messages)
    assert any("decode" in m and "pd-decode" in m and "1 -> 0" in m for m in messages)


def test_unknown_deployment_raises_404(api_client):
    """A missing Deployment is an ActuatorError naming it, its namespace and the 404."""
    actuator = KubernetesActuator({"prefill": "pd-prefill", "decode": "no-such-decode"}, namespace=NS,
                                  api_client=api_client)
    with pytest.raises(ActuatorError) as excinfo:
        actuator.current()
    message = str(excinfo.value)
    assert "no-such-decode" in message and "404" in message and NS in message and "not found" in message


def test_forbidden_raises_403_with_role_hint(api_client):
    """A 403 is an ActuatorError with the status and a hint about the Role on deployments/scale."""
    with pytest.raises(ActuatorError) as excinfo:
        create_actuator(api_client, namespace="locked").current()
    message = str(excinfo.value)
    assert "403" in message and "deployments/scale" in message and "Role" in message
    assert "locked" in message


def test_unreachable_api_raises_actuator_error():
    """A connection error is an ActuatorError naming the deployment and the API host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        configuration = client.Configuration(host=host, proxy=None)
        configuration.retries = 0
        with client.ApiClient(configuration) as api_client:
            with pytest.raises(ActuatorError) as excinfo:
                create_actuator(api_client).apply(PoolSizes(2, 2))
    assert "pd-prefill" in str(excinfo.value) and host in str(excinfo.value)


def test_negative_target_rejected(api_client):
    """A negative pool size is user error: ValueError."""
    with pytest.raises(ValueError):
        create_actuator(api_client).apply(PoolSizes(prefill=-1, decode=1))


def test_namespace_none_falls_back_to_default(api_client, tmp_path, monkeypatch, caplog):
    """namespace=None outside a pod (no service-account namespace file) uses "default" and says so."""
    monkeypatch.setattr(kubernetes_actuator, "SERVICE_ACCOUNT_NAMESPACE_FILE", tmp_path / "missing")
    with caplog.at_level(logging.INFO, logger="cluster.autoscale.kubernetes_actuator"):
        actuator = create_actuator(api_client, namespace=None)
    assert actuator.namespace == "default"
    assert any("default" in r.getMessage() for r in caplog.records)


def test_namespace_none_reads_pod_namespace(fake_api, api_client, tmp_path, monkeypatch):
    """namespace=None in a pod uses the namespace from the service-account file."""
    api, _ = fake_api
    path = tmp_path / "namespace"
    path.write_text(f"{NS}\n")
    monkeypatch.setattr(kubernetes_actuator, "SERVICE_ACCOUNT_NAMESPACE_FILE", path)
    actuator = create_actuator(api_client, namespace=None)
    assert actuator.namespace == NS and actuator.current() == PoolSizes(1, 1)


def test_loads_kubeconfig_outside_a_pod(fake_api, tmp_path, monkeypatch):
    """With api_client=None and no in-cluster config, the kubeconfig is used."""
    api, host = fake_api
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": host}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    actuator = KubernetesActuator(DEPLOYMENTS, namespace=NS)
    assert actuator.current() == PoolSizes(1, 1) and len(api.requests) == 2


def test_no_config_raises_actuator_error(tmp_path, monkeypatch):
    """With api_client=None, no in-cluster config and no kubeconfig: a clear ActuatorError."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    with pytest.raises(ActuatorError, match="kubeconfig"):
        KubernetesActuator(DEPLOYMENTS, namespace=NS)
