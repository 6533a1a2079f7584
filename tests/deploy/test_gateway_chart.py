"""The chart's gateways in a rollout and behind an ingress: a deleted gateway pod sleeps in preStop
while it leaves the Service's endpoints, then drains (gateway/drain.py) within a grace period
that covers both; changed keys reach it without a rollout; an ingress publishes /v1 only, and only
with TLS and an API key unless the values explicitly allow otherwise."""
from __future__ import annotations

import helm_python as helm
import pytest

from gateway.api_keys import hash_api_key
from tests.deploy.test_helm import container, find, loaded_spec, manifests, one, render

KEYS = {"keys": [{"name": "team-a", "sha256": hash_api_key("sk-team-a-0123456789")}]}
TLS = {"enabled": True, "secretName": "pdserve-tls"}


def _gateway(objects: list[dict]) -> tuple[dict, dict]:
    """(pod spec, container) of the gateway Deployment."""
    deployment = one(objects, "Deployment", "pdserve-gateway")
    return deployment["spec"]["template"]["spec"], container(deployment)


@pytest.mark.parametrize("values, pre_stop, drain", [
    (None, 10, 30),
    ({"gateway": {"preStopSeconds": 5}, "spec": {"drain_timeout_s": 90}}, 5, 90),
    ({"gateway": {"preStopSeconds": 0}, "spec": {"drain_timeout_s": 0.5}}, 0, 1),
    ({"spec": {"drain_timeout_s": 0}}, 10, 0),
], ids=["default", "longer-drain", "fractional-drain", "no-drain"])
def test_gateways_sleep_before_sigterm_and_get_the_drain_in_their_grace(values, pre_stop, drain):
    """The gateway container sleeps `gateway.preStopSeconds` in preStop, and the pod's grace period
    is at least that plus the spec's drain bound (rounded up) plus room to write the last chunks
    and exit, so Kubernetes never kills a gateway that is still inside its drain."""
    pod, gateway = _gateway(manifests(values))
    assert gateway["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    assert pod["terminationGracePeriodSeconds"] <= pre_stop + drain + 30  # not a bound nobody meant


def test_changed_keys_do_not_roll_the_gateways():
    """The gateways re-read their keys file when kubelet updates the Secret volume, so a changed
    key list changes the Secret but not the pod template (no rollout); a changed spec still rolls."""
    other = {"keys": [{"name": "team-b", "sha256": hash_api_key("sk-team-b-0123456789")}]}
    before, after = (manifests({"gateway": {"apiKeys": keys}}) for keys in (KEYS, other))
    template = [one(o, "Deployment", "pdserve-gateway")["spec"]["template"] for o in (before, after)]
    assert template[0] == template[1]
    assert one(before, "Secret", "pdserve-api-keys") != one(after, "Secret", "pdserve-api-keys")
    rolled = manifests({"gateway": {"apiKeys": KEYS}, "spec": {"router_policy": "round_robin"}})
    assert one(rolled, "Deployment", "pdserve-gateway")["spec"]["template"] != template[0]


@pytest.mark.parametrize("values", [
    {"gateway": {"apiKeys": KEYS}, "ingress": {"enabled": True, "tls": TLS}},
    {"gateway": {"apiKey": {"existingSecret": "one-key"}}, "ingress": {"enabled": True, "tls": TLS}},
    {"ingress": {"enabled": True, "tls": TLS, "allowWithoutApiKeys": True}},
    {"gateway": {"apiKeys": KEYS}, "ingress": {"enabled": True, "allowWithoutTls": True}},
], ids=["keys-and-tls", "single-key-and-tls", "allowed-without-keys", "allowed-without-tls"])
def test_an_ingress_publishes_only_the_api(values):
    """A rendered ingress routes /v1 (Prefix) and nothing else to the gateways: /health, /ready,
    /metrics and /status stay inside the cluster; TLS is on unless explicitly allowed off."""
    (ingress,) = find(manifests(values), "Ingress")
    (rule,) = ingress["spec"]["rules"]
    assert [(p["path"], p["pathType"]) for p in rule["http"]["paths"]] == [("/v1", "Prefix")]
    assert ("tls" in ingress["spec"]) == (not values["ingress"].get("allowWithoutTls", False))


@pytest.mark.parametrize("values, message", [
    ({"ingress": {"enabled": True, "tls": TLS}}, "without an API key"),
    ({"gateway": {"apiKeys": KEYS}, "ingress": {"enabled": True}}, "without ingress.tls.enabled"),
    ({"ingress": {"enabled": True, "allowWithoutTls": True}}, "without an API key"),
], ids=["no-key", "no-tls", "no-key-tls-allowed"])
def test_an_ingress_without_a_key_or_tls_is_refused(values, message):
    """An ingress that would open the API to anyone, or carry keys in clear text, fails the render
    with one line naming the value to set."""
    with pytest.raises(helm.HelmError, match=message) as caught:
        render(values)
    assert "ingress.allowWithout" in str(caught.value)


def test_tracing_values_reach_the_spec():
    """docs/observability.md's two values: the spec every pod loads sends its traces there, at that ratio."""
    spec = loaded_spec(manifests({"spec": {"otlp_traces_endpoint": "http://otel-collector.observability.svc:4318",
                                           "trace_sample_ratio": 0.05}}))
    assert spec.tracing.traces_url == "http://otel-collector.observability.svc:4318/v1/traces"
    assert spec.trace_sample_ratio == 0.05
