"""KVCacheManager.fork: n > 1 choices of one prompt share its full blocks (reference-counted) and
copy its partial last block (copy on write); no room changes nothing; the hashes a choice inherits
cache its own blocks right."""
from __future__ import annotations

from engine.core.block_manager import KVCacheManager
from engine.core.request import Request
from tests.engine.core.test_block_manager import BLOCK_SIZE, create_requests


def prompt_in(mgr: KVCacheManager, num_tokens: int, rid: str = "p") -> Request:
    req = Request(rid, list(range(100, 100 + num_tokens)))
    assert mgr.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens = num_tokens
    return req


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    mgr = KVCacheManager(16, BLOCK_SIZE)
    parent = prompt_in(mgr, 2 * BLOCK_SIZE + 3)  # blocks: full, full, partial
    (table,) = mgr.get_block_ids("p")
    free_before = mgr.num_free_blocks
    child = Request("p/1", list(parent.prompt_token_ids))
    copies = mgr.fork("p", child, parent.num_tokens)
    (child_table,) = mgr.get_block_ids("p/1")
    assert child_table[:2] == table[:2] and child_table[2] not in table
    assert copies == [(table[2], child_table[2])] and mgr.num_free_blocks == free_before - 1
    assert [mgr.block_pool.blocks[b].ref_cnt for b in table] == [2, 2, 1]
    mgr.free(parent)
    assert [mgr.block_pool.blocks[b].ref_cnt for b in child_table] == [1, 1, 1]
    mgr.free(child)
    mgr.assert_no_leaks()


def test_fork_of_a_prompt_of_whole_blocks_copies_nothing():
    mgr = KVCacheManager(16, BLOCK_SIZE)
    parent = prompt_in(mgr, 2 * BLOCK_SIZE)
    child = Request("p/1", list(parent.prompt_token_ids))
    assert mgr.fork("p", child, parent.num_tokens) == []
    assert mgr.get_block_ids("p/1") == mgr.get_block_ids("p")
    mgr.free(child)
    mgr.free(parent)
    mgr.assert_no_leaks()


def test_fork_without_a_free_block_changes_nothing():
    mgr = KVCacheManager(4, BLOCK_SIZE)  # 3 usable blocks, the prompt takes them all
    parent = prompt_in(mgr, 2 * BLOCK_SIZE + 1)
    refs = [b.ref_cnt for b in mgr.block_pool.blocks]
    assert mgr.fork("p", Request("p/1", list(parent.prompt_token_ids)), parent.num_tokens) is None
    assert [b.ref_cnt for b in mgr.block_pool.blocks] == refs and "p/1" not in mgr.req_to_blocks
    mgr.free(parent)
    mgr.assert_no_leaks()


def test_a_choice_caches_its_own_blocks_under_its_own_tokens():
    """The choices' first tokens differ: the block each completes is cached under its own hash, so a
    later request with choice 1's tokens hits choice 1's block, not choice 0's."""
    mgr = KVCacheManager(16, BLOCK_SIZE)
    parent = prompt_in(mgr, BLOCK_SIZE + BLOCK_SIZE - 1)  # the first token completes block 1
    choices = [Request(f"p/{i}", list(parent.prompt_token_ids)) for i in range(2)]
    mgr.rename("p", "p/0")
    mgr.fork("p/0", choices[1], parent.num_tokens)
    for i, c in enumerate(choices):
        c.num_computed_tokens = parent.num_tokens
        c.output_token_ids.append(7 + i)
        assert mgr.allocate_slots(c, 1) is not None
        c.num_computed_tokens += 1
    later = Request("later", choices[1].all_token_ids + [1])
    (hits,), n = mgr.get_computed_blocks(later)
    assert n == 2 * BLOCK_SIZE and [b.block_id for b in hits] == mgr.get_block_ids("p/1")[0]
    assert hits[1].block_id != mgr.get_block_ids("p/0")[0][1]
    for c in choices + [later]:
        mgr.free(c)
    mgr.assert_no_leaks()


def test_fork_keeps_the_null_entries_of_a_sliding_group():
    """A remote prompt under a window starts with null entries: the choice's table does too, and only
    real blocks are referenced; a global group beside it shares every block."""
    mgr = KVCacheManager(32, BLOCK_SIZE, True, windows=(20, None))
    req = create_requests(1, 70)[0]
    mgr.allocate_slots(req, 70, num_tokens_to_cache=0, num_null_blocks=(3, 0))
    req.num_computed_tokens = 70
    child = Request("c", list(req.prompt_token_ids))
    copies = mgr.fork(req.request_id, child, 70)
    sliding, full = mgr.get_block_ids("c")
    assert sliding[:3] == [0, 0, 0] and len(copies) == 2 and len(full) == 5
    assert mgr.get_block_ids(req.request_id)[1][:4] == full[:4]
    mgr.free(req)
    mgr.free(child)
    mgr.assert_no_leaks()
