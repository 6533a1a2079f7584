"""A KV link that stops answering mid-transfer, in a running 1P1D cluster (in process, the real
transport with a fault-injecting proxy on the decode's control port): every request still ends
with the colocated engine's greedy tokens (recomputed on the decode instance, or retried), both
instances free every block, and once the link heals KV crosses it again."""
from __future__ import annotations

import pytest

from cluster.control.cluster import Cluster
from engine.core.request import SamplingParams
from tests.cluster.control.test_inprocess_pd import spec_for
from tests.helpers import random_prompts
from tests.kvtransfer.faults import FaultProxy

pytestmark = pytest.mark.timeout(180)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("phase", ["layer", "done"])
def test_a_silent_kv_link_loses_no_request_and_leaks_no_block(tiny_path, phase):
    prompts = random_prompts(4, [9, 40], seed=8)
    with Cluster(spec_for(tiny_path, mode="colocated"), use_ray=False) as c:
        want = [s.token_ids for s in c.generate(prompts, PARAMS, timeout_s=60)]
    with Cluster(spec_for(tiny_path, kv_transfer_timeout_s=1.0), use_ray=False) as c:
        decode = next(i for i in c.instances.values() if i.role == "decode")
        sender = next(i for i in c.instances.values() if i.role == "prefill").ranks[0].sender
        info = c.router.decode[decode.instance_id].info
        proxy = FaultProxy(info.kv_endpoints[0].address)
        info.kv_endpoints = (proxy.endpoint(decode.instance_id, 0),)
        proxy.blackhole_from = phase
        streams = c.generate(prompts, PARAMS, timeout_s=120)
        assert [s.error for s in streams] == [None] * len(prompts)
        assert [s.token_ids for s in streams] == want
        stats = c.router.stats
        assert stats["kv_recomputes"] + stats["retries"] >= 1 and sender.stats.get("parts_sent", 0) == 0
        c.assert_no_leaks()
        proxy.heal()
        assert [s.token_ids for s in c.generate(prompts[:1], PARAMS, timeout_s=60)] == want[:1]
        assert sender.stats["parts_sent"] == 1  # the pair was rebuilt: KV crossed again
        c.assert_no_leaks()
        proxy.close()
