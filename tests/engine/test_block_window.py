"""KVCacheManager under a sliding window: blocks released outside it, tables that start null."""
from __future__ import annotations

from engine.block_manager import KVCacheManager
from engine.request import Request
from tests.engine.test_block_manager import BLOCK_SIZE, create_requests


def test_sliding_window_drops_blocks_outside_it():
    """Window 20, blocks of 16: once 100 tokens are computed, the next query (position 100) sees
    keys 81..100, so blocks 0-4 (tokens 0-79) are released, their entries null; freeing the
    request frees the rest once; the released blocks keep their hashes (prefix hits)."""
    mgr = KVCacheManager(32, BLOCK_SIZE, True, window=20)
    req = create_requests(1, 100)[0]
    assert mgr.allocate_slots(req, 100) is not None
    req.num_computed_tokens = 100
    free_before = mgr.num_free_blocks
    assert mgr.drop_out_of_window(req) == 5 == mgr.num_window_freed
    assert mgr.num_free_blocks == free_before + 5
    assert mgr.get_block_ids(req.request_id)[:5] == [0] * 5 and 0 not in mgr.get_block_ids(req.request_id)[5:]
    assert mgr.drop_out_of_window(req) == 5 == mgr.num_window_freed  # idempotent
    twin = Request("twin", list(req.prompt_token_ids))
    hits, n = mgr.get_computed_blocks(twin)
    assert n == 96 and len(hits) == 6  # the released blocks are still in the prefix cache
    mgr.free(twin)
    mgr.free(req)
    mgr.assert_no_leaks()


def test_a_table_may_start_with_null_blocks():
    """A remote prompt under a window reserves only the blocks its KV arrives in: 3 null entries,
    then the rest; caching skips the null ones; freeing frees only the real ones."""
    mgr = KVCacheManager(16, BLOCK_SIZE, True, window=20)
    req = create_requests(1, 70)[0]
    free_before = mgr.num_free_blocks
    new = mgr.allocate_slots(req, 70, num_tokens_to_cache=0, num_null_blocks=3)
    assert len(new) == 2 and mgr.num_free_blocks == free_before - 2
    assert mgr.get_block_ids(req.request_id)[:3] == [0, 0, 0]
    mgr.cache_blocks(req, 70)
    twin = Request("twin", list(req.prompt_token_ids))
    assert mgr.get_computed_blocks(twin)[1] == 0  # block 0 never arrived
    mgr.free(twin)
    mgr.free(req)
    mgr.assert_no_leaks()
