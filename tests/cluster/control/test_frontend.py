"""The gateway's router (cluster/control/frontend.py): its prefix index counts blocks of the size the
prefill instances' engines use, which the attention backend may have rounded up from the spec's."""
from __future__ import annotations

from cluster.control.frontend import create_router
from cluster.spec import ClusterSpec
from cluster.state import InstanceRecord, MemoryState
from engine.core.block_manager import block_hashes
from tests.router.test_router import PARAMS, FakeDecode, FakePrefill


def test_prefix_index_uses_the_block_size_the_prefill_engines_use():
    spec = ClusterSpec(router_policy="prefix_aware", block_size=16, disagg_threshold_tokens=0)
    state = MemoryState()
    p, d = FakePrefill("prefill-0"), FakeDecode("decode-0")
    p.info.block_size = 32  # its backend rounded 16 up
    state.register(InstanceRecord("prefill-0", "prefill", block_size=32))
    router = create_router(spec, state, [p], [d])
    router.start()
    try:
        prompt = list(range(3, 103))  # 100 tokens: 3 full blocks of 32, 6 of 16
        router.submit("a", prompt, PARAMS)
        assert len(p.submitted) == 1
        assert state.longest_prefix(block_hashes(prompt, 32), role="prefill") == {"prefill-0": 3}
        assert state.longest_prefix(block_hashes(prompt, 16), role="prefill") == {"prefill-0": 0}
    finally:
        router.close()
