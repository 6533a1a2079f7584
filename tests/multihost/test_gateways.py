"""Stateless gateways over a controller's instances, on the Helm chart's pods (the `chart`
fixture: every rendered workload running as a pod in a namespace host of the test bed): two
gateways stream together, one dies mid-stream, a new one joins, the controller restarts. SmolLM2,
fp32, greedy: every stream equals the colocated engine's output."""
from __future__ import annotations

import time

import httpx
import pytest

from bench.chart_pods import BED_AUTH
from tests.multihost.conftest import MAX_TOKENS, PROMPTS
from tests.multihost.streams import Stream

pytestmark = pytest.mark.timeout(600)
LONG_TOKENS = 1500  # far more than the time a dead gateway's requests are kept (3 x heartbeat TTL)
CLIENT_TTL_S = 3 * 3.0  # bench.chart_pods.BED_VALUES: heartbeat_ttl_s 3


def checked(stream: Stream, reference: dict[str, str], timeout: float = 300) -> None:
    """The stream finished with the colocated greedy text and exactly MAX_TOKENS tokens."""
    stream.result(timeout)
    assert (stream.error, stream.finish_reason, stream.completion_tokens) == (None, "length", MAX_TOKENS), stream.prompt
    assert stream.text == reference[stream.prompt], stream.prompt


def pods_of(chart, component: str) -> list[str]:
    return sorted(name for name, c in chart.pods.items() if c == component)


def instances(url: str) -> dict[str, dict]:
    answer = httpx.get(f"{url}/status", headers=BED_AUTH, timeout=10)
    return {i["instance_id"]: i for i in answer.json()["instances"]}


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def test_two_gateways_stream_16_requests_equal_to_colocated(chart, reference):
    """16 streams, 8 through each gateway pod at once: every one is the colocated greedy text with
    exactly MAX_TOKENS tokens; both gateways route over the controller's instances."""
    gateways = pods_of(chart, "gateway")
    assert len(gateways) == 2
    urls = [chart.url(g) for g in gateways]
    streams = [Stream(urls[i % 2], p) for i, p in enumerate(PROMPTS * 2)]
    for s in streams:
        checked(s, reference)
    owned = instances(chart.url(pods_of(chart, "controller")[0]))  # ids: a chaos run may have replaced them
    assert sorted(i["role"] for i in owned.values() if i["healthy"]) == ["decode", "prefill"]
    for url in urls:
        assert {k: v["healthy"] for k, v in instances(url).items()} == {k: True for k in owned}


def test_gateway_killed_mid_stream(chart, reference):
    """Gateway A dies (SIGKILL of its pod) while its two long requests stream and gateway B's
    eight run: B's streams are untouched; A's requests are aborted on the decode instance once A
    has been silent for the client TTL (counted in its load), freeing every block."""
    a, b = pods_of(chart, "gateway")
    ctl = chart.url(pods_of(chart, "controller")[0])
    (decode_id,) = [iid for iid, i in instances(ctl).items() if i["role"] == "decode"]
    decode = lambda: instances(ctl)[decode_id]["load"]  # noqa: E731 (published every TTL / 3)
    aborted_before = decode().get("orphans_aborted", 0.0)
    doomed = [Stream(chart.url(a), p, max_tokens=LONG_TOKENS) for p in PROMPTS[:2]]
    wait_until(lambda: all(s.text for s in doomed), 120, "gateway A's long requests to stream")
    survivors = [Stream(chart.url(b), p) for p in PROMPTS]
    chart.kill_pod(a)
    killed_at = time.monotonic()
    try:
        for s in survivors:
            checked(s, reference)
        wait_until(lambda: decode().get("orphans_aborted", 0.0) - aborted_before == 2, 90,
                   "the dead gateway's two requests aborted on decode-0")
        print(f"dead gateway's requests aborted {time.monotonic() - killed_at:.1f} s after the kill "
              f"(client TTL {CLIENT_TTL_S:.0f} s)")
        wait_until(lambda: (load := decode())["running"] == load["waiting"] == load["kv_usage"] == 0, 30,
                   "decode-0 idle with every block free")
        assert all(s.error is not None and s.finish_reason is None for s in doomed)  # cut off, never finished
    finally:
        chart.restart_pod(a)  # a container restarted in place (same address) serves again
        chart.wait_ready(a, 240)
    for s in [Stream(chart.url(a), p) for p in PROMPTS[:2]]:
        checked(s, reference)


def test_new_gateway_serves_with_every_instance(chart, reference):
    """A third gateway pod started later finds every instance in the cluster state and serves."""
    name = chart.start_pod("gateway")
    try:
        chart.wait_ready(name, 240)
        owned = instances(chart.url(pods_of(chart, "controller")[0]))
        assert set(instances(chart.url(name))) == set(owned)
        for s in [Stream(chart.url(name), p) for p in PROMPTS]:
            checked(s, reference)
    finally:
        chart.delete_pod(name)


def test_restarted_controller_recreates_no_instance(chart, reference):
    """The controller pod is killed: the gateways go on serving; its container restarted in place
    (a new raylet on the same address, the old one not yet declared dead by Ray) adopts both
    instances (same ids, same processes) and starts none."""
    ctl = pods_of(chart, "controller")[0]
    before = {iid: [r["pid"] for r in i["ranks"]] for iid, i in instances(chart.url(ctl)).items()}
    chart.kill_pod(ctl)
    for s in [Stream(chart.url(pods_of(chart, "gateway")[0]), p) for p in PROMPTS]:
        checked(s, reference)
    chart.restart_pod(ctl)
    chart.wait_ready(ctl, 240)
    after = instances(chart.url(ctl))
    assert {iid: [r["pid"] for r in i["ranks"]] for iid, i in after.items()} == before
    assert all(i["adopted"] for i in after.values())
