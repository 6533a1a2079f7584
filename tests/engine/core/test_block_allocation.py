"""Where new blocks lie: handed out in id order (a request freed is reused as one run), and a
reservation for remote KV asks for consecutive blocks, so the transfer lands straight in the cache."""
from __future__ import annotations

import random

import engine.core.block_manager as bm
from decode_worker.scheduler import Scheduler
from engine.core.config import SchedulerConfig
from engine.core.request import RequestStatus

from tests.engine.core.test_block_manager import (BLOCK_SIZE, create_manager, create_requests, free_and_assert_no_leaks,
                                             prefill)


def test_new_blocks_come_in_id_order_so_a_freed_request_returns_as_one_run():
    """Which blocks are taken follows the LRU queue; they are handed out sorted, so a request's
    blocks (freed tail first, so reversed in the queue) come back as consecutive ids."""
    mgr = create_manager(num_blocks=37, enable_prefix_caching=False)  # 36 usable: 12 requests x 3 blocks
    reqs = create_requests(12, 40)
    for req in reqs:
        prefill(mgr, req)
    ids = {req.request_id: mgr.get_block_ids(req.request_id)[0] for req in reqs}
    random.Random(0).shuffle(reqs)
    mgr.free(reqs[0])
    (one,) = create_requests(1, 40, start=20)
    _, new = prefill(mgr, one)
    assert [blk.block_id for blk in new] == sorted(ids[reqs[0].request_id])
    assert [blk.block_id for blk in new] == list(range(new[0].block_id, new[0].block_id + 3))
    for req in reqs[1:7]:
        mgr.free(req)
    (six,) = create_requests(1, 6 * 3 * BLOCK_SIZE, start=21)
    _, new = prefill(mgr, six)
    assert [blk.block_id for blk in new] == sorted(i for req in reqs[1:7] for i in ids[req.request_id])
    free_and_assert_no_leaks(mgr, *reqs[7:], one, six)


def _stretches(ids) -> list[tuple[int, int]]:
    """(first id, length) of each stretch of consecutive ids, plain Python."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return [tuple(s) for s in out]


def _fewest(lengths: list[int], n: int) -> int:
    """How few stretches of these lengths can hold n blocks."""
    if any(length >= n for length in lengths):
        return 1
    total = 0
    for k, length in enumerate(sorted(lengths, reverse=True), 1):
        total += length
        if total >= n:
            return k
    raise AssertionError("not enough blocks")


def test_contiguous_takes_the_smallest_stretch_that_fits_else_the_longest():
    pool = bm.BlockPool(21)  # free: 1..20
    held = pool.get_new_blocks(20)
    pool.free_blocks(b for b in held if b.block_id in (2, 3, 4, 5, 6, 9, 10, 11, 14, 15, 16, 17, 18, 19, 20))
    # free stretches: 2-6 (5), 9-11 (3), 14-20 (7)
    assert [b.block_id for b in pool.get_new_blocks(3, contiguous=True)] == [9, 10, 11]
    assert [b.block_id for b in pool.get_new_blocks(4, contiguous=True)] == [2, 3, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(8, contiguous=True)] == [6, 14, 15, 16, 17, 18, 19, 20]
    assert pool.num_free_blocks == 0


def test_contiguous_allocation_keeps_the_pool_consistent_and_needs_the_fewest_stretches():
    """Random allocations (both kinds), frees and prefix-cache hits: the free map always equals the
    free queue, a contiguous allocation spans the fewest stretches the free blocks allow and the
    smallest stretch that fits when one does; nothing leaks."""
    rng = random.Random(0)
    mgr = create_manager(num_blocks=96)
    pool, live, shared = mgr.block_pool, [], (7,) * 2 * BLOCK_SIZE
    for step in range(400):
        while live and (rng.random() < 0.45 or pool.num_free_blocks < 14):
            mgr.free(live.pop(rng.randrange(len(live))))
        (req,) = create_requests(1, rng.randint(33, 12 * BLOCK_SIZE), prefix=shared[:rng.choice([0, 32])],
                                 start=step, id_prefix=f"s{step}-")
        free = _stretches(pool._free_queue)
        (hits,), num_hit = mgr.get_computed_blocks(req)
        contiguous = rng.random() < 0.5
        (new,) = mgr.allocate_slots(req, req.num_tokens - num_hit, (hits,), contiguous=contiguous)
        req.num_computed_tokens = req.num_tokens
        live.append(req)
        got = _stretches(b.block_id for b in new)
        if contiguous and len(new) > 1 and not any(h.ref_cnt == 1 for h in hits):  # hits left the free pool
            assert len(got) == _fewest([length for _, length in free], len(new))
            if len(got) == 1:  # taken from the smallest free stretch that fits
                (source,) = [length for first, length in free if first <= got[0][0] < first + length]
                assert source == min(length for _, length in free if length >= len(new))
        assert [i for i, f in enumerate(pool._is_free) if f] == sorted(pool._free_queue)
    free_and_assert_no_leaks(mgr, *live)


def test_a_decode_reservation_gets_consecutive_blocks_in_a_fragmented_cache():
    """Freeing every other request leaves the free queue's head scattered: an LRU allocation
    spans several stretches; a decode instance's reservation for remote KV gets one."""
    mgr = create_manager(num_blocks=65, enable_prefix_caching=False)
    reqs = create_requests(32, 2 * BLOCK_SIZE)
    for req in reqs:
        prefill(mgr, req)
    for req in reqs[::2]:  # every other request: 16 free stretches of 2 blocks
        mgr.free(req)
    for req in reqs[1:8:2]:  # then 4 neighbours: stretches of 6 blocks appear
        mgr.free(req)
    (lru,) = create_requests(1, 6 * BLOCK_SIZE, start=100)
    (fresh,) = create_requests(1, 6 * BLOCK_SIZE, start=101)
    assert len(_stretches(b.block_id for b in mgr.allocate_slots(lru, lru.num_tokens)[0])) > 1
    decode = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), mgr, max_model_len=1024)
    assert decode.reserve(fresh)
    assert len(_stretches(mgr.get_block_ids(fresh.request_id)[0])) == 1
    decode.finish_request(fresh.request_id, RequestStatus.FINISHED_ABORTED)
    free_and_assert_no_leaks(mgr, *reqs[9::2], lru)
