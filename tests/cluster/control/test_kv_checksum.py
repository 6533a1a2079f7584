"""KV checksums in a running 1P1D cluster (in process, tiny random model, fp32), against the
colocated engine's greedy tokens and top logprobs, with one element of one layer's K altered in
flight (tests/kvtransfer/faults.py `corrupt_in_flight`):

- checksums and payload MACs off (the negative control): the corruption reaches the decode
  instance and its output differs from colocated;
- payload MACs alone (the default where a cluster secret is set): the same as checksums, below;
- checksums on (`kv_checksum`): the mismatch fails the transfer, the request is retried and
  ends exactly as colocated, and the mismatch is counted on the decode instance, in its load
  and on the gateway's /metrics."""
from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from cluster.control.cluster import Cluster
from engine.core.request import SamplingParams
from gateway.metrics import GatewayMetrics
from tests.cluster.control.test_inprocess_pd import spec_for
from tests.helpers import assert_logprobs_close, random_prompts
from tests.kvtransfer.faults import corrupt_in_flight, without_payload_macs

pytestmark = pytest.mark.timeout(120)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = random_prompts(3, [9, 40], seed=11)


def outputs(streams) -> list[tuple[list[int], list[dict[int, float]]]]:
    assert [s.error for s in streams] == [None] * len(streams)
    return [(s.token_ids, s.logprobs) for s in streams]


def same_output(got, want) -> bool:
    """The same greedy tokens and top logprobs (within the 1P1D tests' tolerance)."""
    try:
        assert got[0] == want[0]
        assert_logprobs_close(got[1], want[1])
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def colocated(tiny_path):
    with Cluster(spec_for(tiny_path, mode="colocated"), use_ray=False) as c:
        return outputs(c.generate(PROMPTS, PARAMS, timeout_s=60))


def test_without_checksums_a_corrupted_element_changes_the_output(tiny_path, colocated):
    """The negative control: one element of layer 1's K altered in flight, checksums and payload
    MACs off, the decode instance computes with it and that request's tokens or top logprobs
    differ (the others' do not: one part was altered)."""
    with Cluster(spec_for(tiny_path), use_ray=False) as c:
        without_payload_macs(c)
        with corrupt_in_flight(layer=1, times=1) as fault:
            got = outputs(c.generate(PROMPTS, PARAMS, timeout_s=60))
        assert len(fault.altered) == 1
        assert [same_output(g, w) for g, w in zip(got, colocated)].count(False) == 1  # the corrupted one
        decode = next(i for i in c.instances.values() if i.role == "decode").ranks[0]
        assert decode.receiver.stats.get("kv_checksum_mismatches", 0) == 0 and c.router.stats["retries"] == 0
        c.assert_no_leaks()


def test_with_checksums_the_corruption_is_caught_retried_and_counted(tiny_path, colocated):
    """Checksums on, the same corruption: the receiver's mismatch fails that transfer, the router
    retries the request, every request ends with the colocated tokens and logprobs, and the one
    mismatch shows in the receiver's stats, the decode instance's load and the gateway's /metrics."""
    with Cluster(spec_for(tiny_path, kv_checksum=True), use_ray=False) as c:
        metrics = GatewayMetrics(c)
        with corrupt_in_flight(layer=1, times=1) as fault:
            got = outputs(c.generate(PROMPTS, PARAMS, timeout_s=60))
        assert len(fault.altered) == 1
        assert all(same_output(g, w) for g, w in zip(got, colocated)), (got, colocated)
        decode = next(i for i in c.instances.values() if i.role == "decode")
        assert decode.ranks[0].receiver.stats["kv_checksum_mismatches"] == 1
        assert c.router.stats["retries"] >= 1
        sender = next(i for i in c.instances.values() if i.role == "prefill").ranks[0].sender
        assert sender.compat.kv_checksum and decode.ranks[0].receiver.compat.kv_checksum  # the spec reached both
        assert sender.stats["groups_created"] == 1 and sender.stats.get("groups_failed", 0) == 0  # the pair stayed
        series = f'pdserve_kv_checksum_mismatches_total{{instance_id="{decode.instance_id}",role="decode"}} 1.0'
        deadline = time.monotonic() + 10  # the router refreshes loads every 0.1 s
        while series not in generate_latest(metrics.registry).decode() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert series in generate_latest(metrics.registry).decode()
        c.assert_no_leaks()


def test_the_payload_mac_catches_the_corruption_by_default(tiny_path, colocated):
    """Checksums off, payload MACs on (the default: an in-process cluster has a generated secret):
    the altered part fails its MAC, the request is retried and ends as colocated, and the one
    mismatch is counted in the decode instance's load (pdserve_kv_mac_mismatches_total)."""
    with Cluster(spec_for(tiny_path), use_ray=False) as c:
        with corrupt_in_flight(layer=1, times=1) as fault:
            got = outputs(c.generate(PROMPTS, PARAMS, timeout_s=60))
        assert len(fault.altered) == 1
        assert all(same_output(g, w) for g, w in zip(got, colocated)), (got, colocated)
        decode = next(i for i in c.instances.values() if i.role == "decode")
        assert decode.ranks[0].receiver.stats["kv_mac_mismatches"] == 1 and c.router.stats["retries"] >= 1
        assert decode.client.load()["kv_mac_mismatches"] == 1
        c.assert_no_leaks()
