"""The decode scheduler's remote path on a fake runner output: reserved requests join the batch
only when their KV is ready, and a remote-prefilled request that must be preempted is recomputed
locally from prompt + generated tokens."""
from __future__ import annotations

from decode_worker.scheduler import Scheduler
from engine.core.request import Request, RequestStatus, RunnerOutput, SamplingParams
from engine.core.block_manager import KVCacheManager, block_hashes
from engine.core.config import SchedulerConfig

BLOCK = 4


def create_scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(num_blocks, BLOCK),
                     max_model_len=100)


def create_request(rid: str, num_tokens: int = 2 * BLOCK, max_tokens: int = 4, first: int = 20) -> Request:
    return Request(rid, list(range(first, first + num_tokens)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {r.request_id: token for r in out.new_requests + out.cached_requests if r.sample}
    s.update(out, RunnerOutput(sampled_token_ids=sampled))
    return out


def test_reserved_request_waits_for_kv_then_joins_as_new():
    s = create_scheduler(16)
    assert s.reserve(create_request("rem"))
    assert s.schedule().is_empty  # KV still arriving: nothing to run, nobody blocked
    s.remote_kv_ready("rem", 50)
    out = step(s)
    (new,) = out.new_requests
    assert new.request_id == "rem" and new.token_ids == [50] and new.num_computed_tokens == 2 * BLOCK


def test_reserve_refuses_when_full_and_changes_nothing():
    s = create_scheduler(3)  # 2 usable blocks
    assert s.reserve(create_request("a"))
    assert not s.reserve(create_request("b"))
    assert s.kv.num_free_blocks == 0 and "b" not in s.requests


def test_preempted_remote_request_recomputes_locally():
    """Pool of 5 blocks: a local request and a remote one fill 4; when both need a new block, the
    remote one (last admitted) is preempted, then recomputed locally: its prompt blocks, which
    hold the transferred KV, come back from the prefix cache; the rest is computed here."""
    s = create_scheduler(6)
    s.add_request(create_request("loc", max_tokens=2, first=60))
    step(s)
    assert s.reserve(create_request("rem"))
    s.remote_kv_ready("rem", 50)
    step(s)  # loc takes the last free block; rem cannot grow -> preempted
    rem = s.requests["rem"]
    assert rem.status == RequestStatus.PREEMPTED and rem.num_computed_tokens == 0 and s.num_preemptions == 1
    out = step(s)  # loc finished (max_tokens=2) and freed its blocks: rem recomputes
    (new,) = [r for r in out.new_requests if r.request_id == "rem"]
    assert new.token_ids == [50] and new.num_computed_tokens == 2 * BLOCK
    while s.has_unfinished():
        step(s)
    assert rem.output_token_ids == [50, 7, 7, 7]
    s.kv.assert_no_leaks()


def test_a_window_cut_block_is_never_offered_to_the_prefix_cache():
    """Window 8, an 18-token prompt: the prefill ships tokens 11.. (the first query sees 11-18), so
    blocks 0-1 are null, block 2 (tokens 8-11) holds only token 11's KV and must not be cached (a
    later prompt sharing it would read garbage for 8-10), block 3 (12-15) is whole and cached."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  KVCacheManager(16, BLOCK, windows=(8,)), max_model_len=100)
    req = create_request("w", num_tokens=18)
    assert s.reserve(req)
    s.remote_kv_ready("w", 50)
    hashes = block_hashes(req.prompt_token_ids, BLOCK)
    assert [s.kv.block_pool.get_cached_block(h) is not None for h in hashes] == [False, False, False, True]
