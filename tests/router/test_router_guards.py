"""No router thread dies silently: a handler that raises fails only the request it was handling
(with an explicit error) and its thread goes on; a thread whose loop raises anyway is restarted
by the supervisor and counted."""
from __future__ import annotations

import functools
import threading

import pytest

from decode_worker.engine import RequestOutput
from engine.core.request import SamplingParams
from prefill_worker.worker import PrefillResult
from router.client import InstanceLoad
from router.policy import create_routing_policy
from router.router import Router
from tests.router.test_router import FakeDecode, FakePrefill, _wait_until

pytestmark = pytest.mark.timeout(60)
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def raising_once(fn):
    """`fn`, except that its first call raises RuntimeError (as a bug in it would)."""
    calls, lock = [], threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with lock:
            calls.append(args)
            first = len(calls) == 1
        if first:
            raise RuntimeError("injected")
        return fn(*args, **kwargs)
    return wrapper


def new_router(p: FakePrefill, d: FakeDecode) -> Router:
    """Not started: a test patches it first."""
    return Router([p], [d], create_routing_policy("round_robin"), poll_s=0.02)


def feed(p: FakePrefill, d: FakeDecode, done: set[str]) -> None:
    """Each attempt P got and not fed yet: its first token from P, the rest from D."""
    for msg, _ in list(p.submitted):
        if msg.request_id not in done:
            done.add(msg.request_id)
            p.results.put(PrefillResult(msg.request_id, 11))
            d.outputs.put(RequestOutput(msg.request_id, [12, 13], True, "length", start=1))


@pytest.mark.parametrize("handler,label", [("_place", "place"), ("_on_prefill_result", "prefill_result"),
                                           ("_on_decode_output", "decode_output")])
def test_a_handler_raising_once_fails_only_its_request(handler, label):
    """Three queued requests; the handler raises on its first call: that request ends with an
    explicit error (and is aborted where it ran), the other two complete, nothing is left in the
    router, every router thread is alive, and the error is counted under the handler's name."""
    p, d = FakePrefill("p0"), FakeDecode("d0", capacity=0)
    r = new_router(p, d)
    if handler != "_place":  # the collectors take their handler when they start
        setattr(r, handler, raising_once(getattr(r, handler)))
    r.start()
    streams = [r.submit(rid, [1, 2, 3], PARAMS) for rid in "abc"]  # no room: all queued
    if handler == "_place":  # the placement thread's next try raises
        r._place = raising_once(r._place)
    d.capacity, fed = 3, set()
    _wait_until(lambda: feed(p, d, fed) or all(s.finished_at_s for s in streams), timeout_s=10)
    ends = [s.result(timeout=10) for s in streams]
    assert sorted(s.finish_reason for s in ends) == ["error", "length", "length"]
    failed = next(s for s in ends if s.finish_reason == "error")
    assert "internal error in the router" in failed.error
    assert all(s.token_ids == [11, 12, 13] for s in ends if s is not failed)
    if handler != "_place":  # it was placed: its attempt is aborted on both instances
        _wait_until(lambda: f"{failed.request_id}#0" in p.aborted and f"{failed.request_id}#0" in d.aborted)
        assert f"{failed.request_id}#0" in p.aborted and f"{failed.request_id}#0" in d.aborted
    assert r.num_active == 0 and not r._live and r.stats["failed"] == 1
    assert r.handler_errors[label] == 1 and sum(r.handler_errors.values()) == 1
    assert all(t.is_alive() for t in r.threads) and len(r.threads) == 4  # 2 collectors, placement, loads
    r.close()


def test_a_request_whose_placement_raises_at_submit_ends_with_an_error():
    """The caller's own placement (an empty queue) raising: submit returns a stream that ends
    with an explicit error rather than raising, and the router keeps nothing of it."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = new_router(p, d)
    r.start()
    r._place = raising_once(r._place)
    stream = r.submit("a", [1, 2, 3], PARAMS).result(timeout=10)
    assert stream.finish_reason == "error" and "internal error in the router (place" in stream.error
    assert r.num_active == 0 and not r._live and r.handler_errors["place"] == 1
    r.close()


@pytest.mark.parametrize("thread", ["place_pending", "collect", "refresh_loads"])
def test_a_thread_that_dies_is_restarted_and_counted(thread):
    """The thread's loop raises on its first run (past every guard): the supervisor restarts it,
    counts it under the thread's name, and the thread does its work after all: a queued request
    is placed (place_pending), its outputs are collected (collect), the loads are read
    (refresh_loads)."""
    p, d = FakePrefill("p0"), FakeDecode("d0", capacity=0 if thread == "place_pending" else 100)
    r = new_router(p, d)
    target = f"_{thread}"
    setattr(r, target, raising_once(getattr(r, target)))  # collect: the first collector started (d0's)
    d.load = lambda: {"running": 5.0}
    r.start()
    stream = r.submit("a", [1, 2, 3], PARAMS)  # place_pending: queued (no room)
    d.capacity, fed = 1, set()
    _wait_until(lambda: feed(p, d, fed) or stream.finished_at_s, timeout_s=10)
    assert stream.result(timeout=10).token_ids == [11, 12, 13]
    _wait_until(lambda: d.info.load.running == 5.0, timeout_s=10)
    assert d.info.load == InstanceLoad.of({"running": 5.0})
    assert r.thread_restarts == {"place_pending": 0, "collect": 0, "refresh_loads": 0, thread: 1}
    assert all(t.is_alive() for t in r.threads)
    r.close()
    assert not any(t.is_alive() for t in r.threads)  # stopped, not restarted


def test_a_flipped_instance_s_old_collector_hands_its_last_events_on_and_ends():
    """A flip re-adds instance x with a new client (prefill -> decode) while the old client's collector is
    still in its long poll on the same instance: whichever collector takes x's decode outputs, each goes to
    the decode handler (the old one read them as prefill results, and the stream failed); the old collector
    then ends, and no handler error is counted."""
    old, p1, d0 = FakePrefill("x"), FakePrefill("p1"), FakeDecode("d0", capacity=0)
    r = Router([old, p1], [d0], create_routing_policy("round_robin"), poll_s=0.02, long_poll_s=0.05)
    r.start()
    r.remove_instance("x")
    new = FakeDecode("x")
    new.events = new.outputs = old.events  # one instance: both clients poll its one event queue
    r.add_instance(new)
    streams = [r.submit(f"r{i}", [1, 2, 3], PARAMS) for i in range(6)]
    _wait_until(lambda: len(p1.submitted) == 6 and len(new.reserved) == 6)
    assert len(new.reserved) == 6  # every request decodes on x, each first token from p1
    for msg, _ in p1.submitted:
        p1.results.put(PrefillResult(msg.request_id, 11))
        old.events.put(RequestOutput(msg.request_id, [12, 13], True, "length", start=1))
    ends = [s.result(timeout=10) for s in streams]
    assert [(s.finish_reason, s.token_ids) for s in ends] == [("length", [11, 12, 13])] * 6
    assert sum(r.handler_errors.values()) == 0
    stopped = lambda: [t for t in r.threads if not t.is_alive()]  # noqa: E731
    _wait_until(lambda: len(stopped()) == 1)
    assert [t.name for t in stopped()] == ["router-collect"]  # x's old one; x's new, p1's, d0's go on
    r.close()
