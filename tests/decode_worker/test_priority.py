"""Priority classes in the schedulers (engine/core/priority.py), on a fake runner output: waiting
requests go by class then arrival, the lowest class is preempted first, and a more urgent request,
waiting or refused a reservation, takes room from a lower class's running requests."""
from __future__ import annotations

from collections import deque

import pytest

from decode_worker.scheduler import Scheduler
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig
from engine.core.priority import enqueue
from engine.core.request import Request, RequestStatus, RunnerOutput, SamplingParams
from prefill_worker.scheduler import PrefillScheduler

BLOCK = 4


def request(rid: str, priority: int = 0, num_tokens: int = 2 * BLOCK, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(10, 10 + num_tokens)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority))


def decode_scheduler(num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                     KVCacheManager(num_blocks, BLOCK), max_model_len=100)


def step(s, token: int = 7):
    out = s.schedule()
    sampled = {r.request_id: token for r in out.new_requests + out.cached_requests if r.sample}
    s.update(out, RunnerOutput(sampled_token_ids=sampled))
    return out


def test_enqueue_orders_by_class_then_arrival_and_a_preempted_one_leads_its_class():
    q: deque[Request] = deque()
    for rid, p in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        enqueue(q, request(rid, p))
    assert [r.request_id for r in q] == ["d", "b", "e", "a", "c"]
    enqueue(q, request("pre", 0), ahead=True)
    assert [r.request_id for r in q] == ["d", "pre", "b", "e", "a", "c"]


def test_one_class_keeps_arrival_order():
    q: deque[Request] = deque()
    for i in range(5):
        enqueue(q, request(f"r{i}"))
    assert [r.request_id for r in q] == [f"r{i}" for i in range(5)]


@pytest.mark.parametrize("value", [True, 1.5, "1", 2**31])
def test_priority_must_be_an_int32(value):
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=value)


def test_prefill_admits_the_urgent_class_first():
    s = PrefillScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), KVCacheManager(32, BLOCK),
                         max_model_len=100)
    s.add_request(request("batch", priority=10))
    s.add_request(request("chat", priority=0))
    out = s.schedule()
    assert [r.request_id for r in out.new_requests] == ["chat"]


def test_blocks_run_out_the_lowest_class_is_preempted_not_the_last_admitted():
    """6 usable blocks: two 2-block prompts, the low one admitted first; when neither can grow
    into a third block of its own, the low one goes, though the urgent one came last."""
    s = decode_scheduler(6)
    s.add_request(request("low", priority=9, max_tokens=20))
    step(s)
    s.add_request(request("high", priority=0, max_tokens=20))
    for _ in range(6):
        step(s)
    assert s.requests["high"].num_preemptions == 0
    assert s.requests["low"].num_preemptions >= 1 and s.preemptions_by_class == {9: s.num_preemptions}


def test_waiting_urgent_request_takes_a_seat_from_a_lower_class():
    s = decode_scheduler(32, max_num_seqs=2)
    for rid in ("low1", "low2"):
        s.add_request(request(rid, priority=5, max_tokens=50))
    step(s)
    s.add_request(request("high", priority=0))
    out = step(s)
    assert "high" in [r.request_id for r in out.new_requests]
    assert s.requests["low2"].status == RequestStatus.PREEMPTED  # the lower class's last admitted
    assert s.requests["low1"].status == RequestStatus.RUNNING
    s.add_request(request("same", priority=5))  # of the running class: it waits for a seat, takes none
    step(s)
    assert s.requests["same"].status == RequestStatus.WAITING and s.num_preemptions == 1


def test_refused_reservation_of_an_urgent_class_gets_room_on_the_next_step():
    """A full decode instance refuses an urgent reservation; its next step preempts a lower-class
    request (and keeps the room from the preempted one), so the retried reservation fits."""
    s = decode_scheduler(32, max_num_seqs=2)
    for rid in ("low1", "low2"):
        s.add_request(request(rid, priority=5, max_tokens=50))
    step(s)
    urgent = request("urgent", priority=0)
    assert not s.reserve(urgent)
    step(s)
    assert s.requests["low2"].status == RequestStatus.PREEMPTED
    step(s)  # the room stays the reservation's: the preempted request does not take it back
    assert s.requests["low2"].status == RequestStatus.PREEMPTED
    assert s.reserve(request("urgent", priority=0)) and not s.wanted


def test_refused_reservation_of_the_running_class_claims_nothing():
    s = decode_scheduler(32, max_num_seqs=1)
    s.add_request(request("a", priority=0, max_tokens=50))
    step(s)
    assert not s.reserve(request("b", priority=0)) and not s.wanted
    step(s)
    assert s.num_preemptions == 0
