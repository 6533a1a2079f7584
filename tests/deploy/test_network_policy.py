"""The chart's NetworkPolicies (templates/networkpolicy.yaml), rendered by real Helm, validated
against the Kubernetes schemas, and evaluated with NetworkPolicy's ingress semantics: who may
connect to which pod on which port."""
from __future__ import annotations

from dataclasses import dataclass, field

import kubernetes_validate
import pytest

from tests.deploy.test_helm import NAMESPACE, RELEASE, container, find, manifests, one

pytestmark = pytest.mark.timeout(300)

COMPONENTS = {"gateway": "pdserve-gateway", "controller": "pdserve-controller", "ray-head": "pdserve-head",
              "prefill": "pdserve-prefill", "decode": "pdserve-decode", "redis": "pdserve-redis"}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


@dataclass
class Source:
    """Who connects: a pod's labels and its namespace's labels."""
    labels: dict = field(default_factory=dict)
    namespace: str = NAMESPACE

    @property
    def namespace_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace}


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, src: Source) -> bool:
    assert "ipBlock" not in peer, peer  # none of the chart's peers; the evaluator does not model addresses
    if "namespaceSelector" in peer:
        return _matches(peer["namespaceSelector"], src.namespace_labels) and \
            ("podSelector" not in peer or _matches(peer["podSelector"], src.labels))
    return src.namespace == NAMESPACE and _matches(peer["podSelector"], src.labels)


def _port_admits(rule: dict, port_name: str, pod: dict) -> bool:
    if not rule.get("ports"):
        return True
    number = {p["name"]: p["containerPort"] for p in container(pod).get("ports", [])}.get(port_name)
    return any(p.get("protocol", "TCP") == "TCP" and p["port"] in (port_name, number) for p in rule["ports"])


def allowed(objects: list[dict], src: Source, component: str, port: str) -> bool:
    """Whether `src` may open a TCP connection to `port` (a container port name, or "other" for
    one picked at run time) of the component's pod, as an enforcing CNI decides it."""
    deployment = one(objects, "Deployment", COMPONENTS[component])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in find(objects, "NetworkPolicy") if _matches(p["spec"]["podSelector"], labels)]
    if not policies:
        return True  # not isolated
    return any((not rule.get("from") or any(_peer_admits(peer, src) for peer in rule["from"]))
               and _port_admits(rule, port, deployment)
               for policy in policies for rule in policy["spec"].get("ingress", []))


def release_pod(component: str, release: str = RELEASE) -> Source:
    return Source({"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": release,
                   "app.kubernetes.io/component": component})


OUTSIDER = Source({"app": "anything"}, namespace="elsewhere")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return manifests()


def test_every_pod_is_selected_by_its_own_ingress_policy(objects):
    """Each Deployment's pods are selected by exactly one policy, named after it and selecting
    exactly its pod selector; each restricts ingress only (egress stays open)."""
    policies = find(objects, "NetworkPolicy")
    assert {p["metadata"]["name"] for p in policies} == set(COMPONENTS.values())
    for deployment in find(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies if _matches(p["spec"]["podSelector"], labels)]
        assert [p["metadata"]["name"] for p in selecting] == [deployment["metadata"]["name"]]
        assert selecting[0]["spec"]["podSelector"] == deployment["spec"]["selector"]
        assert selecting[0]["spec"]["policyTypes"] == ["Ingress"] and "egress" not in selecting[0]["spec"]


def test_gateways_take_clients_from_anywhere_on_http_only(objects):
    """Anyone (another namespace, any labels) reaches a gateway's http port and nothing else of
    it; the gateway rule names no source at all, so an Ingress controller or a LoadBalancer works."""
    gateway = one(objects, "NetworkPolicy", "pdserve-gateway")
    assert {"ports": [{"port": "http", "protocol": "TCP"}]} in gateway["spec"]["ingress"]
    assert allowed(objects, OUTSIDER, "gateway", "http")
    assert not allowed(objects, OUTSIDER, "gateway", "other")
    assert allowed(objects, release_pod("decode"), "gateway", "other")  # Ray: tokens and actor calls back


@pytest.mark.parametrize("component", ["controller", "ray-head", "prefill", "decode"])
def test_other_pods_only_from_the_release(objects, component):
    """Controller, Ray head and workers take connections on any port (Ray, KV transfer, gloo and
    NCCL sockets, TCPStore: ports picked at run time) from this release's pods only: not from
    another namespace, nor from another release's pods in the same one."""
    policy = one(objects, "NetworkPolicy", COMPONENTS[component])
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}}}]}]
    for peer in ("gateway", "controller", "ray-head", "prefill", "decode"):
        assert allowed(objects, release_pod(peer), component, "other"), peer
    assert not allowed(objects, OUTSIDER, component, "http")
    assert not allowed(objects, release_pod("decode", release="other-llm"), component, "other")
    assert not allowed(objects, Source(release_pod("decode").labels, namespace="elsewhere"), component, "other")


def test_redis_only_from_the_controller_and_gateways(objects):
    """Only the processes that use the cluster state reach Redis, on its port: not the Ray pods."""
    for peer, reaches in (("controller", True), ("gateway", True), ("prefill", False), ("decode", False),
                          ("ray-head", False)):
        assert allowed(objects, release_pod(peer), "redis", "redis") == reaches, peer
    assert not allowed(objects, release_pod("gateway"), "redis", "other")
    assert not allowed(objects, OUTSIDER, "redis", "redis")


def test_metrics_from_opens_only_the_controllers_http_port():
    """`networkPolicy.metricsFrom` peers (Prometheus' namespace) reach the controller's http
    port (its /metrics), nothing else; every other policy is unchanged."""
    default = {p["metadata"]["name"]: p for p in find(manifests(), "NetworkPolicy")}
    objects = manifests({"networkPolicy": {"metricsFrom": [MONITORING]}})
    prometheus = Source({"app": "prometheus"}, namespace="monitoring")
    assert allowed(objects, prometheus, "controller", "http")
    assert not allowed(objects, prometheus, "controller", "other")
    assert not allowed(objects, prometheus, "prefill", "other") and not allowed(objects, prometheus, "redis", "redis")
    assert not allowed(objects, OUTSIDER, "controller", "http")
    for policy in find(objects, "NetworkPolicy"):
        if policy["metadata"]["name"] != "pdserve-controller":
            assert policy == default[policy["metadata"]["name"]]
    for obj in find(objects, "NetworkPolicy"):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_disabled_renders_none():
    """`networkPolicy.enabled: false` renders no NetworkPolicy: every pod is reachable again."""
    objects = manifests({"networkPolicy": {"enabled": False}})
    assert not find(objects, "NetworkPolicy")
    assert allowed(objects, OUTSIDER, "redis", "redis")


def test_external_redis_has_no_redis_policy():
    """With an external Redis the chart renders no Redis and no policy for it; the rest stay."""
    objects = manifests({"redis": {"enabled": False, "external": {"existingSecret": "redis-conn"}}})
    assert {p["metadata"]["name"] for p in find(objects, "NetworkPolicy")} == set(COMPONENTS.values()) - {
        "pdserve-redis"}
