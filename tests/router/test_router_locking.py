"""The router never holds its lock across a call to an instance: a slow or silent instance
(a host whose link was cut) stalls only the placement that called it."""
from __future__ import annotations

import threading
import time

import pytest

from decode_worker.engine import RequestOutput
from engine.core.request import SamplingParams
from prefill_worker.worker import PrefillResult
from tests.router.test_router import FakeDecode, FakePrefill, make_router

pytestmark = pytest.mark.timeout(30)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class StuckDecode(FakeDecode):
    """A decode instance whose `reserve` does not answer until released."""

    def __init__(self, iid: str):
        super().__init__(iid)
        self.entered, self.release = threading.Event(), threading.Event()

    def reserve(self, msg, prefill_tp):
        self.entered.set()
        self.release.wait(10)
        return super().reserve(msg, prefill_tp)


def _submit_in_thread(router, rid):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("stream", router.submit(rid, [1, 2, 3], PARAMS)))
    t.start()
    return t, out


def test_stuck_reserve_does_not_stall_other_requests():
    """While one placement waits on a silent decode instance, another request is placed on the
    other pair and streams to the end, and the router's tables stay readable."""
    p0, p1, stuck, d1 = FakePrefill("p0"), FakePrefill("p1"), StuckDecode("d0"), FakeDecode("d1")
    r = make_router([p0, p1], [stuck, d1])
    t, _ = _submit_in_thread(r, "slow")  # round robin: d0 first
    assert stuck.entered.wait(5)
    start = time.monotonic()
    stream = r.submit("fast", [4, 5], PARAMS)  # round robin: d1
    (req, _), = p1.submitted
    p1.results.put(PrefillResult(req.request_id, 7))
    d1.outputs.put(RequestOutput(req.request_id, [8], True, "length", start=1))
    assert stream.result(timeout=5).token_ids == [7, 8]
    assert r.num_active == 1 and time.monotonic() - start < 5  # only "slow", still placing
    stuck.release.set()
    t.join(5)
    assert [q.request_id for q, _ in p0.submitted] == ["slow#0"]
    r.close()


def test_abort_while_placing_undoes_the_placement():
    """A client that goes away while its placement waits on an instance: the abort returns at
    once, and the reservation made afterwards is released on both instances."""
    p, stuck = FakePrefill("p0"), StuckDecode("d0")
    r = make_router([p], [stuck])
    t, out = _submit_in_thread(r, "a")
    assert stuck.entered.wait(5)
    start = time.monotonic()
    r.abort("a")
    assert time.monotonic() - start < 1.0
    stuck.release.set()
    t.join(5)
    assert out["stream"].result(timeout=5).finish_reason == "abort"
    deadline = time.monotonic() + 5
    while not ("a#0" in stuck.aborted and "a#0" in p.aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "a#0" in stuck.aborted and "a#0" in p.aborted and r.num_active == 0
    r.close()


def test_instance_dying_during_placement_retries_elsewhere():
    """The decode instance is found dead (by its collector) while a placement's call to it is out:
    the placement is undone and the request runs on the other decode instance."""
    p, stuck, d1 = FakePrefill("p0"), StuckDecode("d0"), FakeDecode("d1")
    r = make_router([p], [stuck, d1])
    t, out = _submit_in_thread(r, "a")
    assert stuck.entered.wait(5)
    r.mark_dead("d0", RuntimeError("link cut"))
    stuck.release.set()
    t.join(5)
    deadline = time.monotonic() + 5
    while not d1.reserved and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d1.reserved[0].request_id == "a#1"
    p.results.put(PrefillResult("a#1", 3))
    d1.outputs.put(RequestOutput("a#1", [4], True, "length", start=1))
    assert out["stream"].result(timeout=5).token_ids == [3, 4]
    assert "a#0" in p.aborted
    r.close()


def test_instance_with_a_placement_in_flight_is_not_drained():
    """A drain must wait for a placement whose calls to the instance are still out (its decode
    instance is not known until they return); removing it then would fail that request."""
    p, stuck = FakePrefill("p0"), StuckDecode("d0")
    r = make_router([p], [stuck])
    t, out = _submit_in_thread(r, "a")
    assert stuck.entered.wait(5)
    r.drain("d0")
    assert not r.is_drained("d0") and not r.is_drained("p0")
    stuck.release.set()
    t.join(5)
    assert not r.is_drained("d0")  # placed there: it decodes there until it finishes
    p.results.put(PrefillResult("a#0", 1))
    stuck.outputs.put(RequestOutput("a#0", [2], True, "length", start=1))
    assert out["stream"].result(timeout=5).token_ids == [1, 2]
    assert r.is_drained("d0") and r.stats["retries"] == 0
    r.close()
