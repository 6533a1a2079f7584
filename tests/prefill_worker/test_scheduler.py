"""The prefill scheduler and the decode scheduler's remote path, on a fake runner output: blocks
enter the prefix cache only once their KV exists, and every block ends free."""
from __future__ import annotations

from decode_worker.scheduler import Scheduler
from engine.core.request import Request, RunnerOutput, SamplingParams
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig
from prefill_worker.scheduler import PrefillScheduler

BLOCK = 4


def create_prefill_scheduler(budget: int = BLOCK, num_blocks: int = 32) -> PrefillScheduler:
    return PrefillScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                            KVCacheManager(num_blocks, BLOCK), max_model_len=100)


def create_request(rid: str, num_tokens: int = 3 * BLOCK + 1) -> Request:
    return Request(rid, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4))


def step(s: PrefillScheduler, token: int = 7):
    out = s.schedule()
    sampled = {r.request_id: token for r in out.new_requests + out.cached_requests if r.sample}
    return out, s.update(out, RunnerOutput(sampled_token_ids=sampled))


def test_chunked_prompt_caches_blocks_as_computed():
    """With a one-block budget, after k steps exactly k blocks are prefix-cache hits."""
    s = create_prefill_scheduler()
    s.add_request(create_request("a"))
    for k in (1, 2):
        step(s)
        assert s.kv.get_computed_blocks(create_request(f"probe{k}"))[1] == k * BLOCK
        s.kv.free(create_request(f"probe{k}"))


def test_abort_mid_prompt_leaves_no_uncomputed_block_cached():
    """Abort after one chunk: a later request with the same prompt hits only that chunk, and
    computes the rest (the other blocks never held KV)."""
    s = create_prefill_scheduler()
    s.add_request(create_request("a"))
    step(s)
    assert s.abort("a")
    s.add_request(create_request("b"))
    out, _ = step(s, token=9)
    assert out.new_requests[0].num_computed_tokens == BLOCK
    while s.has_work():
        _, done = step(s, token=9)
    assert [(r.request_id, t) for r, t in done] == [("b", 9)]
    s.release("b")
    s.kv.assert_no_leaks()


def test_first_token_after_last_chunk_then_release_frees():
    s = create_prefill_scheduler(budget=2 * BLOCK)
    s.add_request(create_request("a"))
    _, done = step(s)
    assert done == [] and s.num_queued_tokens == BLOCK + 1
    _, done = step(s, token=5)
    assert [(r.request_id, t) for r, t in done] == [("a", 5)]
    assert s.kv.num_free_blocks < 31  # held until delivered
    s.release("a")
    s.kv.assert_no_leaks()


def test_decode_reserve_caches_blocks_only_when_kv_arrived():
    """A reserved request's blocks are not prefix-cache hits while its KV is in flight (a failed
    transfer would leave garbage), and are once remote_kv_ready says it arrived."""
    kv = KVCacheManager(32, BLOCK)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=100)
    assert s.reserve(create_request("r"))
    assert kv.get_computed_blocks(create_request("probe"))[1] == 0
    kv.free(create_request("probe"))
    s.remote_kv_ready("r", 3)
    assert kv.get_computed_blocks(create_request("probe"))[1] == 3 * BLOCK
    kv.free(create_request("probe"))
    s.finish_request("r", s.requests["r"].status.__class__.FINISHED_ABORTED)
    kv.assert_no_leaks()
