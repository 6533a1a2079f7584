"""The gateway's router (cluster/control/frontend.py): with `router_policy: prefix_aware` it keeps its
own prefix index, fed by the prefill engines' KV events in each engine's block size (which the
attention backend may have rounded up from the spec's), and writes nothing of it to the cluster state."""
from __future__ import annotations

import threading
import time

from cluster.control.frontend import create_router
from cluster.spec import ClusterSpec
from router.prefix_index import PrefixIndex
from tests.router.test_prefix_index import PROMPT, CachingPrefill
from tests.router.test_router import PARAMS, FakeDecode


def test_the_gateways_router_follows_the_prefill_engines():
    spec = ClusterSpec(router_policy="prefix_aware", block_size=2, disagg_threshold_tokens=0)
    p = CachingPrefill("prefill-0")  # its engine's blocks are 4 tokens, not the spec's 2
    p.cache("a", PROMPT)
    router = create_router(spec, [p], [FakeDecode("decode-0")])
    assert isinstance(router.policy.index, PrefixIndex)
    router.start()
    try:
        deadline = time.monotonic() + 10
        while router.policy.index.num_snapshots < 1:
            assert time.monotonic() < deadline
            threading.Event().wait(0.02)
        assert router.policy.index.longest_prefix(PROMPT, [p.info]) == {"prefill-0": 5}
        router.submit("a", PROMPT, PARAMS)
    finally:
        router.close()
