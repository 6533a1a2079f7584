"""Tenants on a real (in-process) disaggregated cluster whose decode instance runs 4 sequences
(issue 54): an urgent request beside a flood of a lower class starts at once and is never
preempted, while the flood is; a key that floods its class gets its share, not the whole."""
from __future__ import annotations

import statistics
import time

import pytest

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams

pytestmark = pytest.mark.timeout(300)
SEATS = 4


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model="smollm2", dtype="float32", device="cpu", num_prefill=1, num_decode=1,
                       max_num_seqs=SEATS, num_kv_blocks=256, block_size=16, max_num_batched_tokens=512,
                       num_threads=1, kv_transfer_timeout_s=30.0)
    with Cluster(spec, use_ray=False) as c:
        yield c


def prompt(i: int) -> list[int]:
    return [1 + (i * 7 + k) % 500 for k in range(24)]  # distinct prompts: no prefix cache shortcut


def params(priority: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)


def ttft(stream) -> float:
    return stream.first_token_s - stream.arrival_s


def wait_queued(router, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while router.num_queued == 0:
        assert time.monotonic() < deadline, "the flood never filled the decode instance"
        time.sleep(0.01)


def preemptions(cluster) -> float:
    return sum(i.load.figures.get("num_preemptions", 0.0) for i in cluster.instance_infos() if i.role == "decode")


def test_urgent_request_beside_a_lower_class_flood(cluster):
    """Quiet, an urgent (priority 0) request's time to first token is measured alone; then 24 long
    requests of class 10 fill the decode instance and queue behind it. The urgent one's TTFT beside
    them stays within 10x its quiet one plus 1.5 s (first come, first served, it would wait for
    five waves of 96 tokens), it is never preempted, and the flood is (it gave up a seat)."""
    router = cluster.router
    quiet = statistics.median(ttft(cluster.submit(f"quiet{i}", prompt(100 + i), params(0, 8)).result(60))
                              for i in range(3))
    before = preemptions(cluster)
    flood = [cluster.submit(f"low{i}", prompt(i), params(10, 96), tenant="batch") for i in range(24)]
    wait_queued(router)
    urgent = cluster.submit("urgent", prompt(999), params(0, 8), tenant="chat").result(60)
    try:
        assert urgent.finish_reason == "length" and urgent.num_preemptions == 0
        assert ttft(urgent) <= 10 * quiet + 1.5, (ttft(urgent), quiet)
        deadline = time.monotonic() + 30  # the router reads the instance's counters every 0.1 s
        while preemptions(cluster) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert preemptions(cluster) > before  # a lower-class request gave up its seat
    finally:
        for s in flood:
            router.abort(s.request_id)


def test_a_flooding_key_gets_its_share_not_the_whole(cluster):
    """Keys A and B of equal weight: A queues 64 requests, then B 16 (same size). Of the 32
    requests that start first after B's arrive, B's are at least 40% (first come, first served:
    none, all of A's were ahead)."""
    flood = [cluster.submit(f"a{i}", prompt(200 + i), params(0, 8), tenant="A") for i in range(64)]
    wait_queued(cluster.router)
    b_arrival = time.monotonic()
    steady = [cluster.submit(f"b{i}", prompt(300 + i), params(0, 8), tenant="B") for i in range(16)]
    for s in flood + steady:
        s.result(120)
    started = sorted((s.first_token_s, s.request_id[0]) for s in flood + steady if s.first_token_s > b_arrival)
    first = [who for _, who in started[:32]]
    assert first.count("b") / len(first) >= 0.4, first
