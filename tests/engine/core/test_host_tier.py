"""The host tier's books (engine/core/host_tier.py): what the pool evicts is queued for an offload
to a slot, a prompt's next blocks found there are claimed and reloaded into its new blocks, a slot
a reload reads is never taken by the same step's offloads, the least recently used slot goes first,
and the router's index hears of a block only when the tier drops it."""
from __future__ import annotations

from engine.core.block_manager import KVCacheManager, block_hashes
from engine.core.host_tier import HostTier
from engine.core.request import Request
from tests.engine.core.test_block_manager import prefill

A = list(range(10, 26))  # 16 tokens: 4 blocks of 4
B = list(range(100, 132))  # 32 tokens: 8 blocks, the whole pool


def pair(copies) -> tuple[list, list]:
    """A step's (offloads, reloads) (engine/core/tier_copies.py)."""
    return copies.offloads, copies.reloads


def cached(mgr: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens)
    assert prefill(mgr, req) is not None
    mgr.cache_blocks(req, len(tokens))
    mgr.free(req)
    return req


def test_evicted_blocks_are_offloaded_then_reloaded_for_a_prompt_that_needs_them():
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(8, mgr.block_pool)
    a_blocks = [b for b in mgr.block_pool.blocks if b.block_hash is None][1:5]  # what `a` will get
    cached(mgr, "a", A)
    assert tier.take().empty
    cached(mgr, "b", B)  # evicts a's 4 blocks: each offloaded to a slot
    offloads, reloads = pair(tier.take())
    assert sorted(b for b, _ in offloads) == [b.block_id for b in a_blocks] and reloads == []
    assert tier.num_blocks == 4 and tier.stats["offloaded_blocks"] == 4
    again = Request("a2", A + [7, 7])  # a's 4 blocks, then 2 more tokens
    hits, num_hit = mgr.get_computed_blocks(again)
    assert num_hit == 0  # not in the pool any more
    keys = tier.claim_for(mgr, again, num_hit)
    assert keys == block_hashes(A, 4)
    assert mgr.allocate_slots(again, again.num_tokens, hits) is not None
    tier.reload_for(mgr, again, keys, num_hit)
    offloads, reloads = pair(tier.take())
    slots = {s for _, s in offloads}
    assert [b for _, b in reloads] == mgr.get_block_ids("a2")[0][:4]
    assert not slots & {s for s, _ in reloads}  # b's blocks evicted for a2 went to other slots
    mgr.free(again)


def test_a_full_tier_drops_its_least_recently_used_block_and_the_index_hears_of_it():
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(2, mgr.block_pool)
    log = mgr.block_pool.events
    cached(mgr, "a", A)
    cursor = log.seq
    cached(mgr, "b", B)  # evicts 4 blocks into 2 slots: the first 2 are dropped before their copies
    offloads, _ = pair(tier.take())
    events = log.since(cursor)["events"]
    a_hashes = block_hashes(A, 4)
    removed = [h for op, h in events if op == "-"]
    assert len(removed) == 2 and set(removed) < set(a_hashes) and tier.num_blocks == 2
    assert tier.stats == {"offloaded_blocks": 2, "reloaded_blocks": 0, "dropped_blocks": 2, "write_through_skipped": 0}
    assert len(offloads) == 2  # theirs cancelled
    held = set(log.since(-1)["snapshot"])
    assert set(a_hashes) - set(removed) <= held  # in the tier: still held for the index


def test_a_claimed_slot_is_not_taken_by_the_same_steps_offloads():
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(4, mgr.block_pool)
    cached(mgr, "a", A)
    cached(mgr, "b", B)
    tier.take()  # a's 4 blocks in the 4 slots
    keys = tier.claim(block_hashes(A, 4))
    assert len(keys) == 4
    c = Request("c", list(range(200, 232)))  # evicts b's 8 blocks: no slot free but the pinned ones
    assert prefill(mgr, c) is not None
    offloads, _ = pair(tier.take())
    assert offloads == [] and tier.num_blocks == 4  # nothing offloaded: every slot pinned
    tier.release(keys)
    mgr.free(c)


def test_a_paused_tier_offloads_nothing():
    """A decode instance's reservation: the transfer writes its blocks before the next step."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(8, mgr.block_pool)
    cached(mgr, "a", A)
    with tier.paused():
        cached(mgr, "b", B)
    assert tier.take().empty and tier.num_blocks == 0


def test_write_through_copies_each_cached_block_a_step_later_and_holds_it_until_copied():
    """A decode instance's tier: every block the pool caches is copied at the take after next (the
    step that computed it has ended), its block kept from eviction until the copying step ends; a
    later eviction then costs no copy, even one made while the tier is paused (a reservation)."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(8, mgr.block_pool)
    tier.write_through()
    a = Request("a", A)
    assert prefill(mgr, a) is not None  # cached at allocation: this step computes them
    a_ids = mgr.get_block_ids("a")[0]
    mgr.free(a)
    assert mgr.num_free_blocks == 8 - 4  # freed, but held by the tier until copied
    assert tier.take().empty  # the step computing them
    assert mgr.num_free_blocks == 4
    offloads, _ = pair(tier.take())  # the next: they are complete now
    assert [b for b, _ in offloads] == a_ids and tier.num_blocks == 4
    assert mgr.num_free_blocks == 4  # held while that step copies them
    assert tier.take().empty and mgr.num_free_blocks == 8  # released as the next is scheduled
    with tier.paused():  # evicted by a reservation: in the tier already, held for the index
        cached(mgr, "b", B)
    assert tier.num_blocks == 4 and tier.stats["offloaded_blocks"] == 4
    probe = Request("a2", A + [7])
    assert mgr.get_computed_blocks(probe)[1] == 0 and tier.claim_for(mgr, probe, 0) == block_hashes(A, 4)
    mgr.free(probe)
    tier.take()
    tier.drop_pending()
    assert mgr.reset_prefix_cache() and tier.num_blocks == 0
    mgr.assert_no_leaks()



def test_write_through_gives_up_uncopied_blocks_when_the_pool_is_short_and_skips_what_it_holds():
    """An idle instance makes no copy: the blocks still held for one are released, their copies
    given up, by an allocation that needs them; a block reloaded from the tier is not copied back;
    a reset of the prefix cache releases every held block."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(16, mgr.block_pool)
    tier.write_through()
    cached(mgr, "a", A)
    tier.take(), tier.take(), tier.take()
    cached(mgr, "b", B)  # evicts a's 4 blocks: no copy, they are in the tier
    assert mgr.num_free_blocks == 0  # b's 8 blocks held until copied
    again = Request("a2", A + [7])
    assert mgr.get_computed_blocks(again)[1] == 0
    keys = tier.claim_for(mgr, again, 0)
    with tier.paused():  # as a decode instance's reservation
        assert keys == block_hashes(A, 4) and mgr.allocate_slots(again, again.num_tokens) is not None
    assert tier.stats["write_through_skipped"] == 8  # b's copies given up for a2's 5 blocks
    tier.reload_for(mgr, again, keys, 0)  # its 4 blocks cached again at allocation: no copy, no hold
    offloads, reloads = pair(tier.take())
    assert offloads == [] and [b for _, b in reloads] == mgr.get_block_ids("a2")[0][:4]
    assert mgr.num_free_blocks == 8 - 5 and tier.stats["offloaded_blocks"] == 4
    mgr.free(again)
    assert mgr.num_free_blocks == 8 - 4  # the reloaded blocks are held until their step has ended
    tier.release_copied()
    cached(mgr, "c", list(range(300, 308)))  # 2 blocks held for their copies
    assert mgr.num_free_blocks == 6 and mgr.reset_prefix_cache() and tier.num_blocks == 0
    mgr.assert_no_leaks()


def test_a_queued_reloads_blocks_stay_out_of_the_pool_until_its_step_has_run():
    """A decode instance reserves (a reload queued) and the request is aborted before any step runs:
    the blocks the reload will write are not handed out (a transfer would write them first)."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    mgr.tier = tier = HostTier(8, mgr.block_pool)
    cached(mgr, "a", A)
    cached(mgr, "b", B)
    tier.take()  # a's 4 blocks offloaded
    again = Request("a2", A + [7])
    keys = tier.claim_for(mgr, again, mgr.get_computed_blocks(again)[1])
    assert len(keys) == 4 and mgr.allocate_slots(again, again.num_tokens) is not None
    tier.reload_for(mgr, again, keys, 0)
    reloaded = set(mgr.get_block_ids("a2")[0][:4])
    mgr.free(again)  # aborted
    assert mgr.num_free_blocks == 4 and all(mgr.block_pool.blocks[i].ref_cnt == 1 for i in reloaded)
    _, reloads = pair(tier.take())
    assert {b for _, b in reloads} == reloaded and mgr.num_free_blocks == 4
    tier.release_copied()  # the step has run
    assert mgr.num_free_blocks == 8
    mgr.assert_no_leaks()
