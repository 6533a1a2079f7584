"""pdserve across hosts of the test bed (tests/multihost/conftest.py): every rank on its own
node's address, prefill and decode on different hosts, a host killed or cut off mid-burst, a
host joining later. SmolLM2, fp32, greedy: outputs equal the colocated engine's."""
from __future__ import annotations

import time

import httpx
import pytest

from bench.multihost import HostSpec
from cluster.redis_state import RedisState
from tests.multihost.conftest import PROMPTS
from tests.multihost.streams import Stream

pytestmark = pytest.mark.timeout(600)
TTL_S, KV_TIMEOUT_S = 3.0, 6.0
# A request whose host dies or goes silent streams again within the heartbeat TTL (the router's
# liveness deadline) + the KV transfer deadline (a transfer to a silent decode host). Measured
# 2.5 s (kill) and 3.6 s (cut); asserted with 4x slack for a loaded CI box.
BOUND_S = TTL_S + KV_TIMEOUT_S
COMMON = ("--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--max-num-batched-tokens", "512",
          "--heartbeat-ttl-s", str(TTL_S), "--kv-transfer-timeout-s", str(KV_TIMEOUT_S))


def status(url: str) -> list[dict]:
    return httpx.get(f"{url}/status", timeout=10).json()["instances"]


def nodes_of(url: str, role: str, healthy: bool = True) -> dict[str, set[str]]:
    """instance id -> node addresses of its ranks, for the instances of `role`."""
    return {i["instance_id"]: {r["node_ip"] for r in i["ranks"]} for i in status(url)
            if i["role"] == role and i["healthy"] == healthy}


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def assert_equal_colocated(url: str, reference: dict[str, str]) -> None:
    streams = [Stream(url, p) for p in PROMPTS]
    for s in streams:
        s.result(240)
        assert s.error is None and s.finish_reason == "length", (s.prompt, s.error)
        assert s.text == reference[s.prompt], s.prompt


def test_decode_tp3_on_one_host_prefill_on_another_then_a_joining_host_gets_an_instance(bed, serve, reference):
    """Decode tp=3 (d1: its three ranks on d1's address) and prefill (p1) on different hosts give
    the colocated greedy outputs. The autoscaler wants a second tp=3 decode instance, for which no
    node has room; a host that joins later (d3) receives it through the Ray actuator, and serves."""
    url = serve(*COMMON, "--decode-tp", "3", "--num-decode", "1", "--router-policy", "round_robin",
                "--autoscale", "--autoscale-policy", "queue", "--autoscale-actuator", "ray", "--min-decode", "2",
                "--max-decode", "2", "--autoscale-interval-s", "2", "--scale-up-cooldown-s", "1")
    assert list(nodes_of(url, "prefill").values()) == [{bed.address("p1")}]
    assert list(nodes_of(url, "decode").values()) == [{bed.address("d1")}]
    assert all(len({r["pid"] for r in i["ranks"]}) == i["tp_size"] for i in status(url))
    assert_equal_colocated(url, reference)

    bed.add_host(HostSpec("d3", "decode", num_cpus=3, resources={"decode": 3}))
    decodes = wait_until(lambda: len(nodes_of(url, "decode")) == 2 and nodes_of(url, "decode"), 300,
                         "a second decode instance")
    assert sorted(map(sorted, decodes.values())) == [[bed.address("d1")], [bed.address("d3")]]
    assert_equal_colocated(url, reference)  # round robin: half of them decode on d3


def _burst_then(url: str, reference: dict[str, str], break_host, when=all) -> tuple[list[Stream], float]:
    """Starts every prompt, waits until each (`when` any: one) has streamed text, then
    `break_host()`; returns the finished streams (all equal to the colocated outputs) and when the
    host broke."""
    streams = [Stream(url, p) for p in PROMPTS]
    wait_until(lambda: when(s.times for s in streams), 240, "first text")
    broke_at = time.monotonic()
    break_host()
    for s in streams:
        s.result(300)
        assert s.error is None and s.finish_reason == "length", (s.prompt, s.error)
        assert s.text == reference[s.prompt], s.prompt
    return streams, broke_at


def _two_decode_hosts(bed, serve, name: str, *extra: str) -> tuple[str, str]:
    """pdserve (cluster `name`: its Redis key prefix; `extra` flags) with prefill on p1 and one
    decode instance on each of d1 and d2; returns (url, the id of the instance on d2)."""
    url = serve(*COMMON, "--num-decode", "2", "--router-policy", "round_robin", "--cluster-name", name, *extra)
    decodes = nodes_of(url, "decode")
    assert sorted(map(sorted, decodes.values())) == [[bed.address("d1")], [bed.address("d2")]]
    assert list(nodes_of(url, "prefill").values()) == [{bed.address("p1")}]
    return url, next(iid for iid, ips in decodes.items() if ips == {bed.address("d2")})


def _dead_in_state_and_replaced(bed, url: str, dead_id: str, name: str) -> None:
    """The dead instance is marked dead in the cluster state (redis); a replacement decode
    instance serves from another node with room (d1, or d3 if it joined earlier)."""
    state = RedisState(bed.redis_url, namespace=name)
    try:
        wait_until(lambda: (r := state.get(dead_id)) is not None and r.health == "dead", 60, f"{dead_id} dead in redis")
    finally:
        state.close()
    decodes = wait_until(lambda: len(nodes_of(url, "decode")) == 2 and nodes_of(url, "decode"), 300,
                         "a replacement decode instance")
    assert dead_id not in decodes and all(ips and ips != {bed.address("d2")} for ips in decodes.values())


def _break_d2_mid_burst(bed, serve, reference, break_host, what: str, *extra: str, when=all) -> None:
    """The fault tests' body: two decode hosts (`extra` flags), a burst, `break_host()` once every
    stream (`when` any: the first) has text (from both hosts: round robin); checks that every output
    equals colocated, the longest wait for text after the fault, the state and the replacement."""
    name = f"faults-{time.monotonic_ns()}"
    url, on_d2 = _two_decode_hosts(bed, serve, name, *extra)
    streams, broke_at = _burst_then(url, reference, break_host, when)
    gap = max(s.max_gap_after(broke_at) for s in streams)
    print(f"{what}: longest wait for text after it {gap:.2f} s (bound {BOUND_S:.1f} s)")
    assert gap < 4 * BOUND_S, gap
    _dead_in_state_and_replaced(bed, url, on_d2, name)


def test_host_killed_mid_burst_over_nixl(bed, serve, reference):
    """kv_transport nixl (the decode hosts read p1's pool across the bed's links): P on p1, D on d1
    and d2: equal to colocated; every process of d2 SIGKILLed as the burst's first text arrives
    (other prompts' KV still being read, or about to be): every request finishes with the unfailed
    tokens; d2's instance is dead in the cluster state and replaced on a node with room. (The torch
    transport meets the same faults in the link-cut test and the chaos run.)"""
    try:
        _break_d2_mid_burst(bed, serve, reference, lambda: bed.kill_host("d2"), "host killed", "--kv-transport",
                            "nixl", when=any)
    finally:
        bed.restart_host("d2")


def test_host_link_cut_mid_burst(bed, serve, reference):
    """d2's link cut mid-burst (packets vanish, no RST): every request finishes with the unfailed
    tokens, none waits for text longer than the stated bound (heartbeat TTL + KV transfer
    deadline, plus one re-prefill; 4x slack); d2's instance is dead in the cluster state and
    replaced on a node with room."""
    try:
        _break_d2_mid_burst(bed, serve, reference, lambda: bed.cut_link("d2"), "link cut")
    finally:
        bed.restore_link("d2")
        bed.restart_host("d2")
