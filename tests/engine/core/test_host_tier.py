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
    cached(mgr, "b", B)  # evicts 4 blocks into 2 slots: the first 2 are dropped before their copies
    offloads, _ = tier.take()
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
    assert tier.take() == ([], [])  # the step computing them
    assert mgr.num_free_blocks == 4
    offloads, _ = tier.take()  # the next: they are complete now
    assert [b for b, _ in offloads] == a_ids and tier.num_blocks == 4
    assert mgr.num_free_blocks == 4  # held while that step copies them
    assert tier.take() == ([], []) and mgr.num_free_blocks == 8  # released as the next is scheduled
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
    offloads, reloads = tier.take()
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
    _, reloads = tier.take()
    assert {b for _, b in reloads} == reloaded and mgr.num_free_blocks == 4
    tier.release_copied()  # the step has run
    assert mgr.num_free_blocks == 8
    mgr.assert_no_leaks()


class Disk:
    """A disk tier's books (engine/runner/disk_tier.py DiskTier) over a dict: key -> the slot it was
    written from; every spill and load recorded."""

    def __init__(self):
        self.on_forget, self.files, self.calls = None, {}, []

    def has(self, key):
        return key in self.files

    def spill(self, key, slot):
        self.calls.append(("spill", key, slot))
        self.files[key] = slot
        return True

    def spill_block(self, key, block_id):
        self.calls.append(("spill_block", key, block_id))
        self.files[key] = -block_id
        return True

    def load(self, key, slot):
        self.calls.append(("load", key, slot))
        return key in self.files

    def read(self, key):
        self.calls.append(("read", key))
        return [key] if key in self.files else None

    def write_block(self, block_id, tensors):
        self.calls.append(("write_block", tensors[0], block_id))

    def clear(self):
        self.files.clear()

    def figures(self):
        return {}


def test_under_a_full_tier_blocks_go_to_disk_and_come_back_never_through_a_slot_an_offload_fills():
    """The slot a full tier takes back is written to disk first: from the slot, or from the pool
    block its queued copy was to come from (that copy cancelled); a disk read never lands in a slot
    a queued offload fills; a block on disk is still held for the index."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    disk = Disk()
    mgr.tier = tier = HostTier(3, mgr.block_pool, disk)
    log = mgr.block_pool.events
    a = block_hashes(A, 4)
    a_blocks = [b.block_id for b in mgr.block_pool.blocks[1:5]]  # what `a` will get
    cached(mgr, "a", A)
    cursor = log.seq
    cached(mgr, "b", B)  # evicts a's 4 blocks into 3 slots in one step: a[0]'s slot is taken back ...
    assert disk.calls == [("spill_block", a[0], a_blocks[0])]  # ... its block written from the pool
    assert tier.stats["dropped_blocks"] == 0 and not [k for op, k in log.since(cursor)["events"] if op == "-"]
    offloads, _ = tier.take()
    assert sorted(b for b, _ in offloads) == a_blocks[1:]  # a[0]'s copy cancelled, its slot a[3]'s
    c = Request("c", list(range(200, 208)))
    assert prefill(mgr, c) is not None  # evicts 2 of b's blocks: a[1], a[2] leave their slots for disk
    assert [(op, k) for op, k, _ in disk.calls[1:]] == [("spill", a[1]), ("spill", a[2])]
    filling = {s for _, s in tier._offloads}
    again = Request("a2", A + [7])
    assert mgr.get_computed_blocks(again)[1] == 0
    # a[0] read into a[3]'s slot (a[3] to disk); no slot left for the others: read into memory
    assert tier.claim_for(mgr, again, 0) == a
    loads = [(c[1], c[2]) for c in disk.calls if c[0] == "load"]
    assert [k for k, _ in loads] == a[:1] and not {s for _, s in loads} & filling
    assert ("spill", a[3], loads[0][1]) in disk.calls
    assert [c[1] for c in disk.calls if c[0] == "read"] == a[1:]
    assert set(a) <= set(log.since(-1)["snapshot"])  # held for the index all along
    tier.release(a)
    mgr.free(c), mgr.free(again)


def test_the_index_hears_each_blocks_fastest_level_as_the_tiers_move_it():
    """Pool -> host slot or disk as the pool evicts; a slot taken back -> disk; read from disk -> host;
    reloaded and cached -> pool; a block the disk forgets -> news only where no other level holds it."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    disk = Disk()
    mgr.tier = tier = HostTier(3, mgr.block_pool, disk)
    log = mgr.block_pool.events
    a = block_hashes(A, 4)
    cached(mgr, "a", A)
    assert [log.level(k) for k in a] == ["+"] * 4
    cached(mgr, "b", B)  # a's 4 blocks into 3 slots: a[0]'s slot taken back, its block to disk
    assert [log.level(k) for k in a] == ["d", "h", "h", "h"]
    assert log.since(-1)["tiers"] == {"h": a[1:], "d": a[:1]}
    tier.take()
    again = Request("a2", A[:8] + [7])  # a's first 2 blocks, then a token
    assert mgr.get_computed_blocks(again)[1] == 0
    # a[0] read into the least recently used slot (a[1]'s, which goes to disk), then a[1] into a[2]'s
    assert tier.claim_for(mgr, again, 0) == a[:2]
    assert [log.level(k) for k in a] == ["h", "h", "d", "h"]
    assert mgr.allocate_slots(again, again.num_tokens) is not None
    tier.reload_for(mgr, again, a[:2], 0)
    mgr.cache_blocks(again, again.num_tokens)
    assert [log.level(k) for k in a] == ["+", "+", "d", "d"]  # b's blocks evicted for a2 took a[3]'s slot
    cursor = log.seq
    disk.files.pop(a[1])
    disk.on_forget(a[1])  # the disk let a[1] go: the pool holds it, no news
    disk.files.pop(a[2])
    disk.on_forget(a[2])  # nothing holds a[2] now
    assert log.since(cursor)["events"] == [("-", a[2])]
    mgr.free(again)


def test_a_write_through_tier_reports_no_disk_level():
    """A decode instance's reservations claim host slots only: a block its tier spills to disk is
    removed from the index, not held at the disk level."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    disk = Disk()
    mgr.tier = tier = HostTier(1, mgr.block_pool, disk)
    tier.write_through()
    log = mgr.block_pool.events
    cached(mgr, "a", A)
    tier.take(), tier.take(), tier.release_copied()  # a's 4 copies queued for the one slot: 3 of them to disk
    cached(mgr, "b", B)  # evicts a's blocks from the pool
    levels = [log.level(k) for k in block_hashes(A, 4)]
    assert len(disk.files) == 3 and levels.count("h") == 1 and levels.count(None) == 3, (disk.files, levels)


def test_a_prompt_gets_back_more_blocks_from_disk_than_the_tier_has_slots():
    """2 slots, a prompt's 4 blocks on disk: 2 are read into slots (reloaded at the step's start),
    the other 2, with every slot pinned by the claim, into memory and straight into their new pool
    blocks as they are reloaded; a claim released instead leaves nothing behind."""
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    disk = Disk()
    mgr.tier = tier = HostTier(2, mgr.block_pool, disk)
    a = block_hashes(A, 4)
    cached(mgr, "a", A)
    cached(mgr, "b", B)  # a's 4 blocks: 2 to disk as the 2 slots fill ...
    tier.take()
    cached(mgr, "c", list(range(200, 232)))  # ... and b's push the other 2 there too
    tier.take()
    assert set(a) <= set(disk.files) and not set(a) & set(tier._slots)
    again = Request("a2", A + [7])
    assert mgr.get_computed_blocks(again)[1] == 0
    keys = tier.claim_for(mgr, again, 0)
    assert keys == a and [c[:2] for c in disk.calls if c[0] == "read"] == [("read", a[2]), ("read", a[3])]
    assert mgr.allocate_slots(again, again.num_tokens) is not None
    tier.reload_for(mgr, again, keys, 0)
    blocks = mgr.get_block_ids("a2")[0][:4]
    assert [c[1:] for c in disk.calls if c[0] == "write_block"] == [(a[2], blocks[2]), (a[3], blocks[3])]
    _, reloads = tier.take()
    assert [b for _, b in reloads] == blocks[:2]
    tier.release_copied()
    mgr.free(again)
    other = Request("a3", A + [8])
    mgr.get_computed_blocks(other)
    claimed = tier.claim_for(mgr, other, mgr.get_computed_blocks(other)[1])
    tier.release(claimed)
    assert tier.take() == ([], []) and not tier._pinned
