"""Two routers (one per gateway) share the same instances: each receives exactly its own
requests' tokens and prefill results, and the requests of one that stops polling (its gateway
died) are aborted on the instances, their blocks freed, while the other's go on."""
from __future__ import annotations

import time

import pytest

from cluster.control.cluster import Cluster
from engine.core.request import RequestStatus, SamplingParams
from router.policy import create_routing_policy
from router.router import Router
from tests.cluster.control.test_inprocess_pd import spec_for
from tests.helpers import random_prompts, save_tiny_llama

pytestmark = pytest.mark.timeout(180)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def second_router(cluster: Cluster) -> Router:
    """Another gateway's router over the same instances."""
    by_role = lambda *roles: [i.client for i in cluster.instances.values() if i.role in roles]  # noqa: E731
    r = Router(by_role("prefill"), by_role("decode", "colocated"), create_routing_policy("round_robin"))
    r.start()
    return r


def test_two_routers_each_get_their_own_tokens(tiny_path):
    """16 requests, 8 through each router at once, some with the same prompt: every stream gets
    the colocated greedy tokens, each exactly once, and only from its own router."""
    prompts = random_prompts(8, [5, 17, 40], seed=21)
    with Cluster(spec_for(tiny_path, mode="colocated"), use_ray=False) as c:
        want = [s.token_ids for s in c.generate(prompts, PARAMS, timeout_s=60)]
    with Cluster(spec_for(tiny_path), use_ray=False) as c:
        other = second_router(c)
        try:
            mine = [c.submit(f"a{i}", p, PARAMS) for i, p in enumerate(prompts)]
            theirs = [other.submit(f"b{i}", p, PARAMS) for i, p in enumerate(prompts)]
            assert [s.result(timeout=60).token_ids for s in mine] == want
            assert [s.result(timeout=60).token_ids for s in theirs] == want
            assert c.router.stats["completed"] == other.stats["completed"] == 8
            assert c.router.stats["retries"] == other.stats["retries"] == 0
            c.assert_no_leaks()
        finally:
            other.close()


@pytest.fixture(scope="module")
def long_context_path(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-long") / "llama", max_position_embeddings=8192))


def test_silent_router_requests_are_aborted_and_freed(long_context_path):
    """A router that stops polling mid-stream (its gateway died): after the client TTL the
    instances abort its requests and free their blocks; the other router's requests finish."""
    prompts = random_prompts(4, [9, 30], seed=22)
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(long_context_path, heartbeat_ttl_s=0.5, num_kv_blocks=1600), use_ray=False) as c:
        other = second_router(c)
        doomed = [other.submit(f"b{i}", p, long) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while not all(s.first_token_s for s in doomed):
            assert time.monotonic() < deadline, "no first tokens"
            time.sleep(0.05)
        other.close()  # no more polls: as if its process died
        decode = c.instances["decode-0"].ranks[0].worker
        running = lambda: [r for r in decode.engine.scheduler.running if r.request_id.startswith("b")]  # noqa: E731
        orphans = running()
        assert len(orphans) == 4  # still generating, far from 3,000 tokens
        survivors = c.generate(prompts, PARAMS, timeout_s=60)
        assert all(s.error is None and len(s.token_ids) == 12 for s in survivors)
        deadline = time.monotonic() + 30
        while running() or decode.engine.has_unfinished():
            assert time.monotonic() < deadline, "the silent router's requests still run"
            time.sleep(0.1)
        assert all(r.status == RequestStatus.FINISHED_ABORTED for r in orphans)
        assert all(r.num_output_tokens < 3000 for r in orphans)
        assert decode.load()["orphans_aborted"] == 4  # counted, for operators and the bed's tests
        c.assert_no_leaks()
