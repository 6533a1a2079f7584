"""The router's view of its instances' loads (router/loads.py): a burst placed between two reads is
spread by counting each placement into the view, and the reads are paced over many instances."""
from __future__ import annotations

import pytest

from router.client import InstanceInfo, InstanceLoad
from router.loads import MIN_INTERVAL_S, count_placement, next_wait
from tests.router.test_router import PARAMS, FakeDecode, FakePrefill, make_router


def test_a_burst_between_reads_spreads_over_the_least_loaded():
    """The instances' loads never change (the fakes report what they were made with): without the
    placements counted, least_loaded would send all eight to d0 and p0."""
    prefills = [FakePrefill(f"p{k}") for k in range(2)]
    decodes = [FakeDecode(f"d{k}", load={"kv_capacity_tokens": 1000}) for k in range(4)]
    router = make_router(prefills, decodes, policy="least_loaded")
    try:
        for k in range(8):
            router.submit(f"r{k}", [1] * 20, PARAMS)
        assert [len(d.reserved) for d in decodes] == [2, 2, 2, 2]
        assert [len(p.submitted) for p in prefills] == [4, 4]
    finally:
        router.close()


def test_count_placement_adds_the_request_to_the_view():
    p = InstanceInfo("p0", "prefill", 1, load=InstanceLoad.of({"queued_prefill_tokens": 100}))
    d = InstanceInfo("d0", "decode", 1, load=InstanceLoad.of({"reserved": 1, "kv_usage": 0.5,
                                                              "kv_capacity_tokens": 1000}))
    count_placement(p, d, 80, 20)
    assert p.load.queued_prefill_tokens == 180
    assert (d.load.reserved, d.load.kv_usage) == (2, pytest.approx(0.6))
    unknown = InstanceInfo("d1", "decode", 1)  # (no capacity said: its KV share is not guessed)
    count_placement(None, unknown, 80, 20)
    assert (unknown.load.reserved, unknown.load.kv_usage) == (1, 0.0)


def test_reads_are_paced_over_many_instances():
    """Ten times a second over a few instances; at 1,000 (2,000 calls a sweep) about every 4 s."""
    assert next_wait(20, 0.01) == MIN_INTERVAL_S
    assert next_wait(2000, 0.3) == pytest.approx(3.7)
