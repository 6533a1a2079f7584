"""The Helm chart's pods on the multi-host bed (tests/multihost/conftest.py `chart`): every
Deployment of the rendered chart runs as its container declares (command, env, volumes,
Services by name), and the deployment serves through each gateway pod. Gateways and the
controller coming and going: test_gateways.py."""
from __future__ import annotations

import httpx
import pytest

from bench.chart_pods import BED_AUTH

pytestmark = pytest.mark.timeout(600)
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}


def of(chart, component: str) -> list[str]:
    return [name for name, c in chart.pods.items() if c == component]


def chat(url: str) -> str:
    """A greedy chat completion through `url`: its text (asserting 200)."""
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=BED_AUTH, timeout=120)
    assert r.status_code == 200, (url, r.text)
    return r.json()["choices"][0]["message"]["content"]


def test_every_gateway_pod_serves(chart):
    """Through each of the two gateway pods' own addresses: /ready answers 200, and a greedy chat
    completion answers 200 with generated text (the controller's instances, found in Redis)."""
    gateways = of(chart, "gateway")
    assert len(gateways) == 2
    for name in gateways:
        url = chart.url(name)
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200, name
        assert chat(url).strip(), name


def test_ranks_bind_their_pods_address(chart):
    """Every rank runs on its pool's pod and advertises that pod's address (PDSERVE_NODE_IP from
    status.podIP, `ray start --node-ip-address`), as the controller's /status reports."""
    (controller,) = of(chart, "controller")
    instances = httpx.get(f"{chart.url(controller)}/status", timeout=10).json()["instances"]
    assert sorted(i["role"] for i in instances) == ["decode", "prefill"]
    for inst in instances:
        (pod,) = of(chart, inst["role"])
        assert {r["node_ip"] for r in inst["ranks"]} == {chart.address(pod)}, inst


def test_every_declared_probe_passes(chart):
    """Every startup, liveness and readiness probe of every pod passes, checked as the chart
    declares it (httpGet path and named port, tcpSocket, exec inside the pod); and the pods that
    serve something declare some: Redis, the Ray head, the controller and the gateways."""
    checked = {}
    for name, component in chart.pods.items():
        for kind in chart.probes(name):
            assert chart.probe(name, kind), f"{name} ({component}): {kind} fails"
            checked.setdefault(component, set()).add(kind)
    assert checked["redis"] >= {"readinessProbe"} and checked["ray-head"] >= {"readinessProbe"}
    for driver in ("controller", "gateway"):
        assert checked[driver] == {"startupProbe", "livenessProbe", "readinessProbe"}, driver
