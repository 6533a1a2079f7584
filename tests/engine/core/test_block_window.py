"""KVCacheManager under a sliding window: blocks released outside it, tables that start null, and
KV groups of sliding and global layers side by side (Gemma 2)."""
from __future__ import annotations

from engine.core.block_manager import KVCacheManager
from engine.core.request import Request
from tests.engine.core.test_block_manager import BLOCK_SIZE, create_requests


def test_sliding_window_drops_blocks_outside_it():
    """Window 20, blocks of 16: once 100 tokens are computed, the next query (position 100) sees
    keys 81..100, so blocks 0-4 (tokens 0-79) are released, their entries null; freeing the
    request frees the rest once; the released blocks keep their hashes (prefix hits)."""
    mgr = KVCacheManager(32, BLOCK_SIZE, True, windows=(20,))
    req = create_requests(1, 100)[0]
    assert mgr.allocate_slots(req, 100) is not None
    req.num_computed_tokens = 100
    free_before, (before,) = mgr.num_free_blocks, mgr.get_block_ids(req.request_id)
    assert mgr.drop_out_of_window(req) == (5,) and mgr.num_window_freed == 5
    assert mgr.num_free_blocks == free_before + 5
    (table,) = mgr.get_block_ids(req.request_id)
    assert table[:5] == [0] * 5 and 0 not in table[5:]
    assert mgr.drop_out_of_window(req) == (5,) and mgr.num_window_freed == 5  # idempotent
    twin = Request("twin", list(req.prompt_token_ids))
    (hits,), n = mgr.get_computed_blocks(twin)
    # the blocks the window reaches from position 96 (keys 77..96: blocks 4, 5) are hits, the rest null
    assert n == 96 and hits[:4] == [mgr.block_pool.null_block] * 4 and [b.block_id for b in hits[4:]] == before[4:6]
    mgr.free(twin)
    mgr.free(req)
    mgr.assert_no_leaks()


def test_a_table_may_start_with_null_blocks():
    """A remote prompt under a window reserves only the blocks its KV arrives in: 3 null entries,
    then the rest; caching skips the null ones; freeing frees only the real ones."""
    mgr = KVCacheManager(16, BLOCK_SIZE, True, windows=(20,))
    req = create_requests(1, 70)[0]
    free_before = mgr.num_free_blocks
    (new,) = mgr.allocate_slots(req, 70, num_tokens_to_cache=0, num_null_blocks=(3,))
    assert len(new) == 2 and mgr.num_free_blocks == free_before - 2
    assert mgr.get_block_ids(req.request_id)[0][:3] == [0, 0, 0]
    mgr.cache_blocks(req, 70)
    twin = Request("twin", list(req.prompt_token_ids))
    assert mgr.get_computed_blocks(twin)[1] == 0  # block 0 never arrived
    mgr.free(twin)
    mgr.free(req)
    mgr.assert_no_leaks()


def test_a_sliding_group_frees_while_a_global_group_keeps_its_blocks():
    """Windows (20, None), Gemma 2's two groups: 100 computed tokens hold 7 blocks in each table;
    the sliding group releases blocks 0-4, the global one none, so the request holds 9 blocks,
    not 14. A twin hits 96 tokens: every global block, the sliding group's last two."""
    mgr = KVCacheManager(32, BLOCK_SIZE, True, windows=(20, None))
    req = create_requests(1, 100)[0]
    new = mgr.allocate_slots(req, 100)
    assert [len(g) for g in new] == [7, 7] and mgr.num_free_blocks == 31 - 14
    req.num_computed_tokens = 100
    before = mgr.get_block_ids(req.request_id)[0]
    assert mgr.drop_out_of_window(req) == (5, 0) and mgr.num_window_freed == 5
    sliding, full = mgr.get_block_ids(req.request_id)
    assert sliding[:5] == [0] * 5 and 0 not in full and set(sliding[5:]).isdisjoint(full)
    assert mgr.num_free_blocks == 31 - 9
    twin = Request("twin", list(req.prompt_token_ids))
    (s_hits, f_hits), n = mgr.get_computed_blocks(twin)
    null = mgr.block_pool.null_block
    assert n == 96 and s_hits[:4] == [null] * 4 and [b.block_id for b in s_hits[4:]] == before[4:6]
    assert [b.block_id for b in f_hits] == full[:6]
    assert mgr.allocate_slots(twin, 4, (s_hits, f_hits)) is not None
    assert mgr.get_block_ids("twin")[1][:6] == full[:6]
    mgr.free(twin)
    mgr.free(req)
    mgr.assert_no_leaks()


def test_a_hit_needs_the_sliding_blocks_its_window_reads():
    """Once a sliding group's released blocks are evicted, a prefix hit stops where the window
    would read them: the global group alone does not make a hit."""
    mgr = KVCacheManager(16, BLOCK_SIZE, True, windows=(20, None))
    req = create_requests(1, 100)[0]
    mgr.allocate_slots(req, 100)
    req.num_computed_tokens = 100
    mgr.drop_out_of_window(req)
    filler = create_requests(1, 1, start=7)[0]  # takes the 1 never-used block, then the 5 released ones
    mgr.allocate_slots(filler, 6 * BLOCK_SIZE // 2)
    twin = Request("twin", list(req.prompt_token_ids))
    (s_hits, f_hits), n = mgr.get_computed_blocks(twin)
    # every global block is a hit, but a hit of k blocks reads sliding blocks from (16k - 19) // 16 on,
    # and only 5 and 6 are left (held by req): k = 6 needs 4, k = 1 needs 0
    assert all(mgr.block_pool.get_cached_block((1, h)) for h in mgr.get_block_hashes("req0"))
    assert (n, s_hits, f_hits) == (0, [], [])
    mgr.free(twin)
    mgr.free(filler)
    mgr.free(req)
    mgr.assert_no_leaks()
