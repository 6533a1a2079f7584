"""SamplingParams.cache_salt in the block manager: a salt seeds a prompt's hash chain, so prompts of
different salts (or none) never share a prefix block."""
from __future__ import annotations

from dataclasses import replace

import engine.core.block_manager as bm
from tests.engine.core.test_block_manager import (BLOCK_SIZE, create_manager, create_requests,
                                                  free_and_assert_no_leaks, prefill)


def test_a_cache_salt_keeps_prefix_blocks_apart():
    """SamplingParams.cache_salt: the same 100-token prompt under one salt hits the first's 6 full
    blocks; under another salt, or none, it hits nothing, and its block hashes differ from the first
    block on (so no tier, index or peer can match them either)."""
    mgr = create_manager()
    first, again, other, plain = create_requests(4, 100, prefix=list(range(1000, 1100)))
    for req, salt in ((first, "tenant-a"), (again, "tenant-a"), (other, "tenant-b")):
        req.sampling_params = replace(req.sampling_params, cache_salt=salt)
    prefill(mgr, first)
    assert [mgr.get_computed_blocks(r)[1] for r in (again, other, plain)] == [96, 0, 0]
    hashes = {r.request_id: mgr._update_block_hashes(r) for r in (first, again, other, plain)}
    assert hashes[again.request_id] == hashes[first.request_id]
    assert all(a != b for a, b in zip(hashes[first.request_id], hashes[other.request_id]))
    assert all(a != b for a, b in zip(hashes[first.request_id], hashes[plain.request_id]))
    assert bm.block_hashes(first.prompt_token_ids, BLOCK_SIZE, "tenant-a") == hashes[first.request_id]
    assert bm.block_hashes(plain.prompt_token_ids, BLOCK_SIZE) == hashes[plain.request_id]
    for r in (again, other, plain):
        mgr.free(r)
    free_and_assert_no_leaks(mgr, first)
