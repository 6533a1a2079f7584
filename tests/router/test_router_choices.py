"""n > 1 through the router (fake instances): the prompt is placed once (one reservation, one
prefill), each choice streams its own tokens with its index, and when the placement fails before
the fork each choice goes on by itself, with its own seed."""
from __future__ import annotations

import pytest

from decode_worker.engine import RequestOutput
from engine.core.request import SamplingParams
from prefill_worker.worker import PrefillResult
from tests.router.test_router import FakeDecode, FakePrefill, _wait_until, make_router

pytestmark = pytest.mark.timeout(30)
PARAMS = SamplingParams(max_tokens=3, temperature=0.8, seed=10, n=3, ignore_eos=True)


def test_choices_are_placed_once_and_stream_by_index():
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    events = []
    streams = r.submit("a", [1, 2, 3], PARAMS, listener=events.append)
    assert [s.request_id for s in streams] == ["a/0", "a/1", "a/2"]
    (req, _), = p.submitted
    assert req.request_id == "a#0" and req.sampling_params.n == 3 and [q.request_id for q in d.reserved] == ["a#0"]
    p.results.put(PrefillResult("a#0", 10, more_choices=((20, None), (30, None))))
    for i in range(3):  # the decode instance forked "a#0" into "a#0/0" .. "a#0/2"
        d.outputs.put(RequestOutput(f"a#0/{i}", [10 * (i + 1) + 1], False, start=1))
        d.outputs.put(RequestOutput(f"a#0/{i}", [10 * (i + 1) + 2], True, "length", start=2))
    _wait_until(lambda: sum(e.finished for e in events) == 3)
    for i in range(3):
        mine = [e for e in events if e.index == i]
        assert [t for e in mine for t in e.token_ids] == [10 * (i + 1) + k for k in range(3)]
        assert mine[-1].finish_reason == "length"
    assert r.stats["completed"] == 3 and not r._by_attempt and not r._live
    r.close()


def test_a_failed_placement_sends_each_choice_on_alone():
    """P fails before the fork (after streaming the first tokens): each choice is retried as a request
    of its own, its prompt the prompt and its token, its seed its own (10 + index)."""
    p0, p1, d = FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0")
    r = make_router([p0, p1], [d])
    streams = r.submit("a", [1, 2], PARAMS)
    first = p0 if p0.submitted else p1
    first.results.put(PrefillResult("a#0", 10, more_choices=((20, None), (30, None))))
    _wait_until(lambda: all(s._events.qsize() for s in streams))
    first.results.put(PrefillResult("a#0", None, "KV transfer failed"))
    _wait_until(lambda: len(d.reserved) == 4)
    retries = {q.request_id: q for q in d.reserved[1:]}
    assert sorted(retries) == ["a/0#1", "a/1#1", "a/2#1"] and "a#0" in d.aborted
    for i in range(3):
        q = retries[f"a/{i}#1"]
        assert q.prompt_token_ids == (1, 2, 10 * (i + 1)) and q.sampling_params.n == 1
        assert q.sampling_params.seed == 10 + i and q.sampling_params.max_tokens == 2
        retry = p0 if any(q.request_id == f"a/{i}#1" for q, _ in p0.submitted) else p1
        retry.results.put(PrefillResult(f"a/{i}#1", 7))
        d.outputs.put(RequestOutput(f"a/{i}#1", [8], True, "length", start=1))
    assert [s.result(timeout=5).token_ids for s in streams] == [[10, 7, 8], [20, 7, 8], [30, 7, 8]]
    r.close()


def test_a_dead_decode_after_the_fork_retries_only_unfinished_choices():
    p, d0, d1 = FakePrefill("p0"), FakeDecode("d0"), FakeDecode("d1")
    r = make_router([p], [d0, d1])
    streams = r.submit("a", [1, 2], PARAMS)
    first, second = (d0, d1) if d0.reserved else (d1, d0)
    p.results.put(PrefillResult("a#0", 5, more_choices=((5, None), (4, None))))
    first.outputs.put(RequestOutput("a#0/0", [6, 7], True, "length", start=1))
    _wait_until(lambda: streams[0]._events.qsize() == 3)  # its token, the decode's two, the end
    first.dead = True
    _wait_until(lambda: len(second.reserved) == 2)
    assert sorted(q.request_id for q in second.reserved) == ["a/1#1", "a/2#1"]
    assert {q.request_id: q.prompt_token_ids for q in second.reserved} == {"a/1#1": (1, 2, 5), "a/2#1": (1, 2, 4)}
    r.close()


def test_abort_ends_every_choice():
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    streams = r.submit("a", [1, 2], PARAMS)
    r.abort("a")
    assert [s.result(timeout=5).finish_reason for s in streams] == ["abort"] * 3
    assert "a#0" in d.aborted and "a#0" in p.aborted and not r._live
    r.close()


def test_abort_after_the_fork_reaches_every_choice():
    """The client goes away while the choices decode: each is aborted on the decode instance."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    streams = r.submit("a", [1, 2], PARAMS)
    p.results.put(PrefillResult("a#0", 4, more_choices=((4, None), (4, None))))
    for i in range(3):
        d.outputs.put(RequestOutput(f"a#0/{i}", [5], False, start=1))
    _wait_until(lambda: all(s._events.qsize() for s in streams))
    r.abort("a")
    assert [s.result(timeout=5).finish_reason for s in streams] == ["abort"] * 3
    _wait_until(lambda: {"a#0/0", "a#0/1", "a#0/2"} <= set(d.aborted))
    assert {"a#0/0", "a#0/1", "a#0/2"} <= set(d.aborted) and not r._live and not r._by_attempt
    r.close()


def test_a_request_an_instance_refuses_is_a_bad_request():
    """reserve raising ValueError (n beyond max_num_seqs): every choice ends with the reason, marked
    the request's own fault (the gateway answers 400), not retried."""
    class Refusing(FakeDecode):
        def reserve(self, req, prefill_tp):
            raise ValueError("n=3 is more choices than this instance runs at once (max_num_seqs 2)")
    p, d = FakePrefill("p0"), Refusing("d0")
    r = make_router([p], [d])
    events = []
    r.submit("a", [1, 2], PARAMS, listener=events.append)
    _wait_until(lambda: len(events) == 3)
    assert all(e.bad_request and "max_num_seqs" in e.error for e in events) and r.stats["retries"] == 0
    r.close()
