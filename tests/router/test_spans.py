"""The router's spans (router/spans.py) against fake instances: each attempt is a span under the
request's, carrying the pair chosen; a retried request shows both attempts, the failed one with its
error; the attempt's traceparent is what the instances get; the phase times reach the end event."""
from __future__ import annotations

import pytest
from opentelemetry.trace import StatusCode

from engine.core import tracing
from decode_worker.engine import RequestOutput
from prefill_worker.worker import PrefillResult
from tests.router.test_router import PARAMS, FakeDecode, FakePrefill, _wait_until, make_router

pytestmark = pytest.mark.timeout(30)


def test_a_retried_request_shows_both_attempts(spans):
    """p0 fails the first attempt (no first token): the request goes on p1. Both attempts are spans
    under the request's, the first ended with the error; each instance got its own attempt's
    traceparent; the end event carries the router's queue time and the instances' phase times."""
    p0, p1, d = FakePrefill("p0"), FakePrefill("p1", load=5.0), FakeDecode("d0")
    r = make_router([p0, p1], [d], policy="least_loaded")
    root = tracing.start("gateway", "request", None)
    stream = r.submit("a", [1, 2, 3], PARAMS, trace=tracing.context_of(root))
    (first, _), = p0.submitted
    p0.results.put(PrefillResult("a#0", None, "prefill exploded"))
    _wait_until(lambda: p1.submitted)
    (second, _), = p1.submitted
    p1.results.put(PrefillResult("a#1", 11, timings={"prefill_queue": 0.01, "prefill": 0.02}))
    d.outputs.put(RequestOutput("a#1", [12, 13], True, "length", start=1,
                                timings={"kv_transfer": 0.03, "decode": 0.04}))
    stream.result(timeout=5)
    root.end()
    r.close()
    by_name = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    attempts = sorted(by_name["router.attempt"], key=lambda s: s.attributes["pdserve.attempt"])
    assert [a.attributes["pdserve.prefill_instance"] for a in attempts] == ["p0", "p1"]
    assert attempts[0].status.status_code == StatusCode.ERROR and "prefill exploded" in attempts[0].status.description
    assert [a.attributes["pdserve.outcome"] for a in attempts] == ["failed", "length"]
    assert attempts[1].status.status_code != StatusCode.ERROR
    ctx = root.get_span_context()
    assert all(a.parent.span_id == ctx.span_id and a.context.trace_id == ctx.trace_id
               for a in attempts + by_name["router.queue"])
    assert [first.trace_context, second.trace_context] == [
        f"00-{ctx.trace_id:032x}-{a.context.span_id:016x}-{int(a.context.trace_flags):02x}" for a in attempts]
    assert [e.name for e in attempts[1].events] == ["first_token", "decoding"]


def test_the_end_event_carries_the_phase_times():
    """Untraced (tracing off): the phase times still reach the request's end event (usage.timings)."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    events = []
    r.submit("a", [1, 2, 3], PARAMS, listener=events.append)
    (msg, _), = p.submitted
    assert msg.trace_context == ""
    p.results.put(PrefillResult("a#0", 11, timings={"prefill_queue": 0.01, "prefill": 0.02}))
    d.outputs.put(RequestOutput("a#0", [12, 13], True, "length", start=1,
                                timings={"kv_transfer": 0.03, "decode": 0.04}))
    _wait_until(lambda: events and events[-1].finished)
    r.close()
    timings = events[-1].timings
    assert set(timings) == {"queue", "prefill_queue", "prefill", "kv_transfer", "decode"} and timings["queue"] >= 0
    assert [timings[k] for k in ("prefill_queue", "prefill", "kv_transfer", "decode")] == [0.01, 0.02, 0.03, 0.04]
