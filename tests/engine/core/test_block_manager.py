"""KVCacheManager / BlockPool: allocation, prefix caching, LRU eviction, hashing, leaks."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import engine.core.block_manager as bm
from engine.core.block_manager import BlockPool, KVCacheManager, hash_block_tokens
from engine.core.request import Request

BLOCK_SIZE = 16
REPO_ROOT = Path(__file__).resolve().parents[3]


def create_manager(num_blocks: int = 128, block_size: int = BLOCK_SIZE,
                   enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching)


def create_requests(n: int, num_tokens: int, prefix: tuple[int, ...] | list[int] = (),
                    start: int = 0, id_prefix: str = "req") -> list[Request]:
    """`n` requests whose prompts are `prefix` followed by distinct tokens, `num_tokens` in all.

    Suffix tokens of request `start + i` are unique to it (as long as callers use disjoint
    `start` ranges), so two requests share full blocks only through `prefix`."""
    assert len(prefix) <= num_tokens < 10_000
    reqs = []
    for i in range(start, start + n):
        suffix = [100_000 + i * 10_000 + j for j in range(num_tokens - len(prefix))]
        reqs.append(Request(f"{id_prefix}{i}", list(prefix) + suffix))
    return reqs


def prefill(mgr: KVCacheManager, req: Request):
    """Admit `req` like a scheduler would: prefix hits, then allocate the rest in one chunk.

    Returns:
        (computed_blocks, new_blocks), or None if it did not fit (nothing changed).
    """
    computed, num_computed = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_computed, computed)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return computed[0], new[0]


def decode_step(mgr: KVCacheManager, req: Request, token_id: int):
    """Append a sampled token, then allocate a slot for it (as the next step does)."""
    req.output_token_ids.append(token_id)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new if new is None else new[0]


def free_all(mgr: KVCacheManager, *reqs: Request) -> None:
    for req in reqs:
        mgr.free(req)


def free_and_assert_no_leaks(mgr: KVCacheManager, *reqs: Request) -> None:
    """Free every request, then check that no request, reference or block is left."""
    free_all(mgr, *reqs)
    mgr.assert_no_leaks()


def ref_cnts(mgr: KVCacheManager, block_ids) -> list[int]:
    return [mgr.block_pool.blocks[i].ref_cnt for i in block_ids]


def snapshot(mgr: KVCacheManager):
    pool = mgr.block_pool
    return ([b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            list(pool._free_queue), {h: b.block_id for h, b in pool._cached.items()},
            {r: [b.block_id for b in t] for r, (t,) in mgr.req_to_blocks.items()},
            {r: list(h) for r, h in mgr.req_to_block_hashes.items()}, dict(mgr.num_cached_block))


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 33, 64, 100])
def test_allocation_grows_block_tables(num_tokens):
    """A table always has ceil(tokens / block_size) distinct non-null blocks, through
    prefill and decode steps that cross block boundaries; free gives all back."""
    mgr = create_manager()
    reqs = create_requests(3, num_tokens)
    for req in reqs:
        _, new = prefill(mgr, req)
        assert len(new) == len(mgr.get_block_ids(req.request_id)[0]) == math.ceil(num_tokens / BLOCK_SIZE)
    for step in range(40):
        for req in reqs:
            before = mgr.get_block_ids(req.request_id)[0]
            new = decode_step(mgr, req, 7 + step)
            table = mgr.get_block_ids(req.request_id)[0]
            assert len(table) == math.ceil(req.num_computed_tokens / BLOCK_SIZE)
            assert table[:len(before)] == before and len(new) == len(table) - len(before) <= 1
    all_ids = [i for r in reqs for i in mgr.get_block_ids(r.request_id)[0]]
    assert len(all_ids) == len(set(all_ids)) and 0 not in all_ids
    assert mgr.num_free_blocks == 127 - len(all_ids) and mgr.num_requests == 3
    free_and_assert_no_leaks(mgr, *reqs)


def test_chunked_prefill_grows_table_per_chunk():
    """Chunks of a long prompt extend the same table; only the missing blocks are new."""
    mgr = create_manager()
    (req,) = create_requests(1, 100)
    for chunk in [10, 10, 30, 50]:
        new = mgr.allocate_slots(req, chunk)
        req.num_computed_tokens += chunk
        assert len(mgr.get_block_ids(req.request_id)[0]) == math.ceil(req.num_computed_tokens / BLOCK_SIZE)
        assert new is not None
    assert mgr.allocate_slots(req, 0) == ([],)
    free_and_assert_no_leaks(mgr, req)


def test_allocate_returns_none_without_side_effects():
    """When too few blocks are free, allocate_slots returns None and changes nothing."""
    mgr = create_manager(num_blocks=5)  # 4 usable
    a, b = create_requests(2, 40)
    assert prefill(mgr, a) is not None  # 3 blocks
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, b.num_tokens) is None
    assert snapshot(mgr) == before and mgr.num_requests == 1
    assert decode_step(mgr, a, 1) == []  # 41 tokens still fit in 3 blocks
    free_and_assert_no_leaks(mgr, a, b)  # b was never allocated: freeing it is a no-op


def test_touched_free_hits_are_not_counted_as_free():
    """Cached unreferenced hits sit in the free queue; touching them takes them out, so
    allocate_slots must not count them twice (fails cleanly, or fits exactly)."""
    mgr = create_manager(num_blocks=9)  # 8 usable
    (a,) = create_requests(1, 65)
    prefill(mgr, a)
    mgr.free(a)  # 4 full blocks stay cached, all 8 free
    prefix = a.prompt_token_ids[:64]
    (too_big,) = create_requests(1, 64 + 70, prefix=prefix, start=1)  # 9 blocks: 4 hits + 5 new
    (computed,), _ = mgr.get_computed_blocks(too_big)
    assert len(computed) == 4
    before = snapshot(mgr)
    assert mgr.allocate_slots(too_big, too_big.num_tokens - 64, (computed,)) is None
    assert snapshot(mgr) == before
    mgr.free(too_big)
    (fits,) = create_requests(1, 64 + 60, prefix=prefix, start=2)  # 8 blocks: 4 hits + 4 new
    computed, new = prefill(mgr, fits)
    assert len(computed) == 4 and len(new) == 4 and mgr.num_free_blocks == 0 and mgr.usage == 1.0
    assert ref_cnts(mgr, [b.block_id for b in computed]) == [1] * 4
    free_and_assert_no_leaks(mgr, fits)


def test_prefix_hit_shares_full_blocks_of_200_token_prefix():
    """A second request sharing a 200-token prefix gets the 12 shared full blocks (192
    tokens); they are the first request's blocks, and their ref counts go to 2."""
    mgr = create_manager()
    (shared,) = create_requests(1, 200, id_prefix="shared")
    a, b = create_requests(2, 250, prefix=shared.prompt_token_ids)
    prefill(mgr, a)
    a_ids = mgr.get_block_ids(a.request_id)[0]
    (computed,), num_computed = mgr.get_computed_blocks(b)
    assert (len(computed), num_computed) == (12, 192)
    assert [blk.block_id for blk in computed] == a_ids[:12]
    assert ref_cnts(mgr, a_ids[:12]) == [1] * 12  # get_computed_blocks does not touch
    (new,) = mgr.allocate_slots(b, b.num_tokens - num_computed, (computed,))
    b_ids = mgr.get_block_ids(b.request_id)[0]
    assert b_ids[:12] == a_ids[:12] and b_ids[12:] == [blk.block_id for blk in new]
    assert len(b_ids) == math.ceil(250 / BLOCK_SIZE)
    assert ref_cnts(mgr, a_ids[:12]) == [2] * 12 and ref_cnts(mgr, a_ids[12:]) == [1] * 4
    assert mgr.get_block_hashes(b.request_id)[:12] == mgr.get_block_hashes(a.request_id)[:12]
    assert mgr.get_block_hashes(b.request_id)[12] != mgr.get_block_hashes(a.request_id)[12]
    mgr.free(a)
    assert ref_cnts(mgr, a_ids[:12]) == [1] * 12
    free_and_assert_no_leaks(mgr, b)


def test_hit_on_unreferenced_cached_blocks():
    """Blocks of a finished request stay findable; a hit takes them out of the free queue."""
    mgr = create_manager(num_blocks=32)
    (a,) = create_requests(1, 80)
    prefill(mgr, a)
    a_ids = mgr.get_block_ids(a.request_id)[0]
    mgr.free(a)
    assert mgr.num_free_blocks == 31 and mgr.usage == 0.0
    (b,) = create_requests(1, 90, prefix=a.prompt_token_ids, start=1)
    computed, new = prefill(mgr, b)
    assert [blk.block_id for blk in computed] == a_ids  # 5 full blocks, all hit
    assert ref_cnts(mgr, a_ids) == [1] * 5
    assert mgr.num_free_blocks == 31 - 6 and mgr.usage == pytest.approx(6 / 31)
    free_and_assert_no_leaks(mgr, b)


@pytest.mark.parametrize("num_tokens,expected_hits", [(1, 0), (16, 0), (64, 3), (65, 4), (79, 4)])
def test_cap_leaves_one_token_to_compute(num_tokens, expected_hits):
    """At most (num_tokens - 1) // block_size blocks hit, so the last token is computed."""
    mgr = create_manager()
    (a,) = create_requests(1, num_tokens)
    prefill(mgr, a)
    b = Request("same-prompt", list(a.prompt_token_ids))
    (computed,), num_computed = mgr.get_computed_blocks(b)
    assert (len(computed), num_computed) == (expected_hits, expected_hits * BLOCK_SIZE)
    assert num_computed < b.num_tokens
    assert len(mgr.get_block_hashes(a.request_id)) == num_tokens // BLOCK_SIZE  # all full ones cached
    prefill(mgr, b)
    free_and_assert_no_leaks(mgr, a, b)


def test_only_known_and_scheduled_full_blocks_are_cached():
    """A block enters the hash map once it is full of known tokens that are computed or
    being computed; slots beyond the known tokens are never hashed."""
    mgr = create_manager()
    (a,) = create_requests(1, 100)
    mgr.allocate_slots(a, 20)
    assert len(mgr.get_block_hashes(a.request_id)) == 1
    a.num_computed_tokens = 20
    mgr.allocate_slots(a, 40)
    assert len(mgr.get_block_hashes(a.request_id)) == 3
    a.num_computed_tokens = 60
    mgr.allocate_slots(a, 40 + 28)  # lookahead past the 100 known tokens
    assert len(mgr.get_block_hashes(a.request_id)) == 100 // BLOCK_SIZE
    assert len(mgr.get_block_ids(a.request_id)[0]) == math.ceil(128 / BLOCK_SIZE)
    (probe,) = create_requests(1, 120, prefix=a.prompt_token_ids, start=1)
    assert mgr.get_computed_blocks(probe)[1] == 96
    free_and_assert_no_leaks(mgr, a, probe)


def test_block_hashes_computed_incrementally(monkeypatch):
    """Each full block of a request is hashed once, not once per step."""
    calls = []
    real = bm.hash_block_tokens
    monkeypatch.setattr(bm, "hash_block_tokens", lambda p, t: calls.append(1) or real(p, t))
    mgr = create_manager()
    (a,) = create_requests(1, 40)
    prefill(mgr, a)
    for step in range(100):
        decode_step(mgr, a, step)
    assert len(calls) == a.num_tokens // BLOCK_SIZE == len(mgr.get_block_hashes(a.request_id))
    free_and_assert_no_leaks(mgr, a)


def test_duplicate_content_keeps_existing_mapping():
    """Two requests that computed the same blocks side by side: the hash map keeps the
    first block, the second request's copies stay uncached and vanish on free."""
    mgr = create_manager()
    (a,) = create_requests(1, 48)
    b = Request("twin", list(a.prompt_token_ids))
    hits_a, hits_b = mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)
    assert hits_a == hits_b == (([],), 0)
    prefill(mgr, a)
    mgr.allocate_slots(b, b.num_tokens)
    a_ids, b_ids = mgr.get_block_ids(a.request_id)[0], mgr.get_block_ids(b.request_id)[0]
    assert set(a_ids).isdisjoint(b_ids)
    hashes = mgr.get_block_hashes(a.request_id)
    assert mgr.get_block_hashes(b.request_id) == hashes
    assert [mgr.block_pool.get_cached_block(h).block_id for h in hashes] == a_ids
    assert all(mgr.block_pool.blocks[i].block_hash is None for i in b_ids)
    free_all(mgr, a, b)
    assert len(mgr.block_pool._cached) == 3
    mgr.assert_no_leaks()


def test_prefix_caching_disabled():
    """With caching off nothing is hashed or shared."""
    mgr = create_manager(enable_prefix_caching=False)
    a, b = create_requests(2, 100, prefix=list(range(80)))
    prefill(mgr, a)
    assert mgr.get_computed_blocks(b) == (([],), 0)
    prefill(mgr, b)
    assert set(mgr.get_block_ids(a.request_id)[0]).isdisjoint(mgr.get_block_ids(b.request_id)[0])
    assert mgr.get_block_hashes(a.request_id) == [] and not mgr.block_pool._cached
    free_and_assert_no_leaks(mgr, a, b)


def test_lru_eviction_oldest_freed_first_and_tail_before_head():
    """Free blocks are reused oldest-freed first, and within a request tail first."""
    mgr = create_manager(num_blocks=9)  # 8 usable
    a, b = create_requests(2, 49)  # 3 full (cached) blocks + 1 partial each
    prefill(mgr, a)
    prefill(mgr, b)
    a_ids, b_ids = mgr.get_block_ids(a.request_id)[0], mgr.get_block_ids(b.request_id)[0]
    assert mgr.num_free_blocks == 0
    free_all(mgr, a, b)

    def hits(req):
        probe = Request(f"probe-{req.request_id}", req.prompt_token_ids)
        num_hits = len(mgr.get_computed_blocks(probe)[0][0])
        mgr.free(probe)  # forgets the hashes get_computed_blocks kept for it
        return num_hits

    (c,) = create_requests(1, 32, start=10)
    _, new = prefill(mgr, c)
    assert {blk.block_id for blk in new} == {a_ids[3], a_ids[2]}
    assert (hits(a), hits(b)) == (2, 3)
    (d,) = create_requests(1, 32, start=11)
    _, new = prefill(mgr, d)
    assert {blk.block_id for blk in new} == {a_ids[1], a_ids[0]}
    assert (hits(a), hits(b)) == (0, 3)
    (e,) = create_requests(1, 32, start=12)
    _, new = prefill(mgr, e)
    assert {blk.block_id for blk in new} == {b_ids[3], b_ids[2]}
    assert hits(b) == 2
    free_and_assert_no_leaks(mgr, a, b, c, d, e)


def test_hit_refreshes_recency():
    """A cached block that is hit and freed again moves to the back of the eviction order."""
    mgr = create_manager(num_blocks=9)
    a, b = create_requests(2, 49)
    prefill(mgr, a)
    prefill(mgr, b)
    a_ids, b_ids = mgr.get_block_ids(a.request_id)[0], mgr.get_block_ids(b.request_id)[0]
    free_all(mgr, a, b)  # eviction order: A3 A2 A1 A0 B3 B2 B1 B0
    (a2,) = create_requests(1, 40, prefix=a.prompt_token_ids[:32], start=5)
    computed, new = prefill(mgr, a2)  # hits A0 A1, takes A3 for its partial block
    assert [blk.block_id for blk in computed + new] == [a_ids[0], a_ids[1], a_ids[3]]
    mgr.free(a2)  # eviction order: A2 B3 B2 B1 B0 A3 A1 A0
    (c,) = create_requests(1, 48, start=10)
    _, new = prefill(mgr, c)
    assert {blk.block_id for blk in new} == {a_ids[2], b_ids[3], b_ids[2]}
    probe = Request("probe", list(a2.prompt_token_ids))
    assert len(mgr.get_computed_blocks(probe)[0][0]) == 2
    free_and_assert_no_leaks(mgr, probe, c)


def test_evicted_blocks_are_no_longer_hits():
    """Reusing a cached free block drops its hash: the old prefix misses afterwards."""
    mgr = create_manager(num_blocks=4)  # 3 usable
    (a,) = create_requests(1, 33)
    prefill(mgr, a)
    hashes = mgr.get_block_hashes(a.request_id)
    mgr.free(a)
    assert all(mgr.block_pool.get_cached_block(h) is not None for h in hashes)
    (b,) = create_requests(1, 40, start=1)
    prefill(mgr, b)
    assert all(mgr.block_pool.get_cached_block(h) is None for h in hashes)
    assert mgr.get_computed_blocks(Request("probe", a.prompt_token_ids)) == (([],), 0)
    free_and_assert_no_leaks(mgr, b, Request("probe", a.prompt_token_ids))


def test_reset_prefix_cache():
    """reset_prefix_cache refuses while blocks are referenced, then forgets every hash."""
    mgr = create_manager()
    (a,) = create_requests(1, 64)
    prefill(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert len(mgr.get_computed_blocks(Request("p1", a.prompt_token_ids))[0][0]) == 3
    free_all(mgr, a, Request("p1", a.prompt_token_ids))
    assert mgr.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in mgr.block_pool.blocks) and not mgr.block_pool._cached
    assert mgr.get_computed_blocks(Request("p2", a.prompt_token_ids)) == (([],), 0)
    free_and_assert_no_leaks(mgr, Request("p2", a.prompt_token_ids))


def test_hashes_are_chained():
    """The same block tokens after different prefixes hash differently; a request whose
    first block differs gets no hits even when later blocks match."""
    tokens = list(range(16))
    h0, h1 = hash_block_tokens(None, [1] * 16), hash_block_tokens(None, [2] * 16)
    assert hash_block_tokens(h0, tokens) != hash_block_tokens(h1, tokens)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(0, tokens)
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    mgr = create_manager()
    a = Request("a", [1] * 16 + tokens + [5])
    b = Request("b", [2] * 16 + tokens + [5])
    prefill(mgr, a)
    assert mgr.get_computed_blocks(b) == (([],), 0)
    prefill(mgr, b)
    ha, hb = mgr.get_block_hashes("a"), mgr.get_block_hashes("b")
    assert ha[1] != hb[1] and ha == [h0, hash_block_tokens(h0, tokens)]
    free_and_assert_no_leaks(mgr, a, b)


GOLDEN = {"first": 3056791716588488810, "second": 1505821141519314614}


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_are_deterministic_across_processes(hash_seed):
    """Equal inputs give equal 64-bit ints, pinned, and the same in another process with
    a different PYTHONHASHSEED (hashes are published to a cluster-wide index)."""
    first = hash_block_tokens(None, list(range(16)))
    assert first == hash_block_tokens(None, list(range(16))) == GOLDEN["first"] < 2 ** 64
    assert hash_block_tokens(first, list(range(16, 32))) == GOLDEN["second"]
    code = ("from engine.core.block_manager import hash_block_tokens as h; f = h(None, list(range(16)));"
            "print(f, h(f, list(range(16, 32))))")
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == [GOLDEN["first"], GOLDEN["second"]]


def test_user_errors_raise():
    """Bad sizes and misuse raise ValueError and leave the manager unchanged."""
    with pytest.raises(ValueError):
        BlockPool(1)
    with pytest.raises(ValueError):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError):
        BlockPool(4).get_new_blocks(4)
    mgr = create_manager(num_blocks=16)
    (a,) = create_requests(1, 40)
    with pytest.raises(ValueError):
        mgr.allocate_slots(a, -1)
    prefill(mgr, a)
    b = Request("b", list(a.prompt_token_ids))
    computed, _ = mgr.get_computed_blocks(b)
    with pytest.raises(ValueError):  # hits can only start a table
        mgr.allocate_slots(a, 1, computed)
    with pytest.raises(KeyError):
        mgr.get_block_ids("unknown")[0]
    free_and_assert_no_leaks(mgr, a, b)


def test_assert_no_leaks_detects_leaks():
    """assert_no_leaks fails while a request holds blocks."""
    mgr = create_manager()
    (a,) = create_requests(1, 10)
    prefill(mgr, a)
    with pytest.raises(AssertionError):
        mgr.assert_no_leaks()
    free_and_assert_no_leaks(mgr, a)


def check_model(mgr: KVCacheManager, live: dict[str, Request], allocated: dict[str, int]) -> None:
    """Ref counts, free queue and hash map agree with the live requests' tables."""
    pool, bs = mgr.block_pool, mgr.block_size
    expected = [0] * pool.num_blocks
    for rid, req in live.items():
        table = mgr.req_to_blocks.get(rid, [[]])[0]
        assert len(table) == math.ceil(allocated[rid] / bs)
        assert len({b.block_id for b in table}) == len(table) and pool.null_block not in table
        hashes = mgr._update_block_hashes(req)
        for i, blk in enumerate(table):
            expected[blk.block_id] += 1
            if blk.block_hash is not None:  # a cached block holds exactly this prefix
                assert blk.block_hash == hashes[i]
    assert [b.ref_cnt for b in pool.blocks] == expected
    assert set(pool._free_queue) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert mgr.num_free_blocks == expected[1:].count(0)
    assert all(b.block_hash == h for h, b in pool._cached.items())
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool._cached)


def stress_admit(mgr: KVCacheManager, rng: random.Random, req: Request,
                 live: dict[str, Request], allocated: dict[str, int]) -> None:
    """Prefix hits plus a random first chunk; a failed allocation must change nothing."""
    computed, num_computed = mgr.get_computed_blocks(req)
    assert num_computed < req.num_tokens
    chunk = rng.randrange(1, req.num_tokens - num_computed + 1)
    before = snapshot(mgr)
    if mgr.allocate_slots(req, chunk, computed) is None:
        assert snapshot(mgr) == before
        mgr.free(req)
        return
    req.num_computed_tokens = num_computed + chunk
    live[req.request_id], allocated[req.request_id] = req, req.num_computed_tokens


def stress_step(mgr: KVCacheManager, rng: random.Random, req: Request,
                live: dict[str, Request], allocated: dict[str, int]) -> None:
    """A prefill chunk or a decode token; on failure nothing changed, maybe preempt."""
    if req.num_computed_tokens == req.num_tokens:
        req.output_token_ids.append(rng.randrange(50))
    num_new = rng.randrange(1, req.num_tokens - req.num_computed_tokens + 1)
    before = snapshot(mgr)
    if mgr.allocate_slots(req, num_new) is None:
        assert snapshot(mgr) == before
        if rng.random() < 0.5:  # preempt under memory pressure
            mgr.free(req)
            del live[req.request_id], allocated[req.request_id]
        return
    req.num_computed_tokens += num_new
    allocated[req.request_id] = req.num_computed_tokens


def test_randomized_stress_against_ref_count_model():
    """Random admissions (with shared prefixes), chunked prefill, decode, preemption and
    finishes keep ref counts, free queue and hash map consistent, failed allocations are
    side-effect free, and everything ends leak-free."""
    rng = random.Random(0)
    mgr = create_manager(num_blocks=48, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]
    live: dict[str, Request] = {}
    allocated: dict[str, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.25 or not live:
            prompt = rng.choice(prefixes)[:rng.randrange(0, 40)]
            prompt += [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            stress_admit(mgr, rng, Request(f"r{step}", prompt), live, allocated)
        elif op < 0.85:
            stress_step(mgr, rng, live[rng.choice(sorted(live))], live, allocated)
        else:
            req = live.pop(rng.choice(sorted(live)))
            del allocated[req.request_id]
            mgr.free(req)
        check_model(mgr, live, allocated)
    free_and_assert_no_leaks(mgr, *live.values())
