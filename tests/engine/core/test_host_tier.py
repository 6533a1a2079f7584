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
    assert tier.take() == ([], [])
    cached(mgr, "b", B)  # evicts a's 4 blocks: each offloaded to a slot
    offloads, reloads = tier.take()
    assert sorted(b for b, _ in offloads) == [b.block_id for b in a_blocks] and reloads == []
    assert tier.num_blocks == 4 and tier.stats["offloaded_blocks"] == 4
    again = Request("a2", A + [7, 7])  # a's 4 blocks, then 2 more tokens
    hits, num_hit = mgr.get_computed_blocks(again)
    assert num_hit == 0  # not in the pool any more
    keys = tier.claim_for(mgr, again, num_hit)
    assert keys == block_hashes(A, 4)
    assert mgr.allocate_slots(again, again.num_tokens, hits) is not None
    tier.reload_for(mgr, again, keys, num_hit)
    offloads, reloads = tier.take()
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
    cached(mgr, "b", B)  # evicts 4 blocks into 2 slots: the first 2 offloaded are dropped again
    tier.take()
    events = log.since(cursor)["events"]
    a_hashes = block_hashes(A, 4)
    removed = [h for op, h in events if op == "-"]
    assert len(removed) == 2 and set(removed) < set(a_hashes) and tier.num_blocks == 2
    assert tier.stats == {"offloaded_blocks": 4, "reloaded_blocks": 0, "dropped_blocks": 2}
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
    offloads, _ = tier.take()
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
    assert tier.take() == ([], []) and tier.num_blocks == 0
