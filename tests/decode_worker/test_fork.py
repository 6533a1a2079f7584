"""n > 1 on the decode scheduler (fake runner outputs): a request prefilled once forks into its
choices, which share the prompt's blocks and copy its partial last block before their first step;
each has its own seed and first token; one that finds no block waits and is recomputed."""
from __future__ import annotations

import pytest

from decode_worker.scheduler import Scheduler
from engine.core.request import Request, RequestStatus, RunnerOutput, SamplingParams, choice_id
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig

BLOCK = 4
EOS = 2


def create_scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(num_blocks, BLOCK),
                     max_model_len=100)


def create_request(n: int, num_tokens: int = 2 * BLOCK + 1, seed: int | None = 5) -> Request:
    return Request("g", list(range(20, 20 + num_tokens)), SamplingParams(max_tokens=4, n=n, seed=seed),
                   eos_token_ids=frozenset({EOS}))


def test_remote_prompt_forks_into_its_choices():
    s = create_scheduler(16)
    assert s.reserve(create_request(3))
    (table,) = s.kv.get_block_ids("g")
    got = s.remote_kv_ready("g", 50, None, ((51, None), (52, None)))
    assert [r.request_id for r in got] == [choice_id("g", i) for i in range(3)] == ["g/0", "g/1", "g/2"]
    assert [r.output_token_ids for r in got] == [[50], [51], [52]]
    assert [r.sampling_params.seed for r in got] == [5, 6, 7] and all(r.sampling_params.n == 1 for r in got)
    assert "g" not in s.requests and s.take_forks() == [("g", got)]
    out = s.schedule()
    assert len(out.block_copies) == 2 and all(src == table[2] for src, _ in out.block_copies)
    tables = {r.request_id: r.block_ids[0] for r in out.new_requests}
    assert tables["g/0"][:3] == table and all(t[:2] == table[:2] for t in tables.values())
    assert sorted(t[2] for t in tables.values()) == sorted([table[2]] + [dst for _, dst in out.block_copies])
    assert {r.request_id: r.token_ids for r in out.new_requests} == {"g/0": [50], "g/1": [51], "g/2": [52]}
    assert "g" in out.finished_req_ids
    for rid in list(s.requests):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    s.kv.assert_no_leaks()


def test_a_choice_whose_first_token_ends_it_finishes_while_the_others_run():
    s = create_scheduler(16)
    assert s.reserve(create_request(2))
    first, second = s.remote_kv_ready("g", EOS, None, ((51, None),))
    assert first.status == RequestStatus.FINISHED_STOPPED and second.status == RequestStatus.RUNNING
    out = s.schedule()
    assert [r.request_id for r in out.new_requests] == ["g/1"]
    s.finish_request("g/1", RequestStatus.FINISHED_ABORTED)
    s.kv.assert_no_leaks()


def test_a_choice_without_a_block_for_its_copy_is_recomputed():
    s = create_scheduler(5)  # 4 usable blocks: the prompt takes 3, one copy fits, the next does not
    assert s.reserve(create_request(3))
    got = s.remote_kv_ready("g", 50, None, ((51, None), (52, None)))
    assert [r.status for r in got] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert got[2].output_token_ids == [52] and got[2].num_computed_tokens == 0
    for rid in ("g/0", "g/1"):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()  # room now: the prompt's blocks come back from the prefix cache, the rest is computed
    (new,) = out.new_requests
    assert new.request_id == "g/2" and new.num_computed_tokens == 2 * BLOCK and new.token_ids == [28, 52]
    s.finish_request("g/2", RequestStatus.FINISHED_ABORTED)
    s.kv.assert_no_leaks()


def test_colocated_prefill_forks_after_its_step():
    s = create_scheduler(16)
    s.add_request(create_request(2, seed=None))
    out = s.schedule()
    (new,) = out.new_requests
    assert new.request_id == "g" and new.sample
    result = RunnerOutput(sampled_token_ids={"g": 60}, choices={"g": [(60, None), (61, None)]})
    got = s.update(out, result)
    assert [(r.request_id, r.output_token_ids) for r in got] == [("g/0", [60]), ("g/1", [61])]
    assert all(r.sampling_params.seed is None for r in got)
    out = s.schedule()
    assert "g" in out.finished_req_ids and len(out.block_copies) == 1
    assert sorted(r.request_id for r in out.new_requests) == ["g/0", "g/1"]
    for rid in list(s.requests):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    s.kv.assert_no_leaks()


def test_choices_count_against_max_num_seqs():
    """A request's n choices run side by side: reserve counts them, and more than the instance ever
    runs at once is refused by name."""
    s = create_scheduler(64)  # max_num_seqs 8
    assert s.reserve(create_request(5))
    assert not s.reserve(Request("h", list(range(9)), SamplingParams(max_tokens=4, n=4)))
    with pytest.raises(ValueError, match=r"n=9 .* \(max_num_seqs 8\)"):
        s.reserve(Request("big", list(range(9)), SamplingParams(max_tokens=4, n=9)))
    with pytest.raises(ValueError, match="n=9"):
        s.add_request(Request("big", list(range(9)), SamplingParams(max_tokens=4, n=9)))
