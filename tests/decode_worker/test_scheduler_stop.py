"""The decode scheduler's stop check on a fake runner output: a request ends on one of its
`stop_token_ids`, asked of their set (`SamplingParams.stop_token_set`), so a check costs the same
however many ids the request gave (it runs for every token of every choice, under the worker lock)."""
from __future__ import annotations

from decode_worker.scheduler import Scheduler
from engine.core.request import Request, RequestStatus, RunnerOutput, SamplingParams
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig

BLOCK = 4
NUM_BLOCKS = 16


class CountingTuple(tuple):
    """A tuple that counts the membership tests made on it."""

    num_lookups = 0

    def __contains__(self, item) -> bool:
        self.num_lookups += 1
        return super().__contains__(item)


def create_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(NUM_BLOCKS, BLOCK),
                     max_model_len=100)


def step(s: Scheduler, token: int) -> None:
    out = s.schedule()
    s.update(out, RunnerOutput(sampled_token_ids={r.request_id: token for r in out.new_requests + out.cached_requests
                                                  if r.sample}))


def test_stop_token_ids_end_the_request_through_the_set():
    """1024 stop ids: tokens outside them go on, the first inside ends the request (stop_reason that
    id, its blocks freed), and the ids' tuple is never searched: the set answers."""
    ids = CountingTuple(range(1000, 2024))
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=ids)
    object.__setattr__(params, "stop_token_ids", ids)  # __post_init__ made a plain tuple of it
    s = create_scheduler()
    free = s.kv.num_free_blocks
    req = Request("r", list(range(20, 28)), params)
    s.add_request(req)
    for token in (7, 999, 2024):  # the prefill's token, then two decode steps: none of them stops
        step(s, token)
        assert req.status == RequestStatus.RUNNING
    step(s, 1500)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 1500
    assert req.output_token_ids == [7, 999, 2024, 1500] and ids.num_lookups == 0
    assert not s.has_unfinished() and s.kv.num_free_blocks == free


def test_stop_token_set_is_the_ids_as_given():
    """The set holds exactly the ids, from any iterable; the tuple keeps their order (it is what
    crosses processes) and equal params stay equal whether or not the set was asked for."""
    a, b = SamplingParams(stop_token_ids=[9, 5, 9]), SamplingParams(stop_token_ids=(9, 5, 9))
    assert a.stop_token_set == frozenset({5, 9}) and a.stop_token_ids == (9, 5, 9)
    assert a == b and hash(a) == hash(b)
    assert SamplingParams().stop_token_set == frozenset()
