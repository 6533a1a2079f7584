"""One HTTP generation's trace and phase times (engine/core/tracing.py, docs/observability.md).

`RequestTrace` opens the request's server span where the request arrives: under the client's own
W3C `traceparent` when it sent one (whose sampled flag then decides), else as a new trace sampled
by the spec's trace_sample_ratio. The gateway's phases (parse, template, tokenize) become its child
spans; the router's attempts and the instances' phases hang under it in their own processes. The
response returns the span's `traceparent` (traced requests only).

At the end, the request's phase times (the gateway's prepare, the router's queue, the instances'
PHASES, TTFT and end to end) go to the phase histograms, with the trace id as an exemplar where
the request was traced, to the span as attributes, and (return_timings) to the client: `usage.timings`
in milliseconds, and, on a non-streaming answer, a `Server-Timing` header."""
from __future__ import annotations

import time

from engine.core import tracing

GATEWAY_PHASES = ("parse", "template", "tokenize")  # its child spans; together, the phase "prepare"


class RequestTrace:
    def __init__(self, route: str, headers, request_id: str | None = None):
        self.arrival_ns = time.time_ns()
        self.span = tracing.start("gateway", f"POST {route}", headers.get("traceparent"), self.arrival_ns,
                                  {"http.route": route}, server=True)  # None when tracing is off
        self.context = tracing.context_of(self.span)  # "" when not traced: nothing downstream records
        self.request_id = request_id
        self.prepare_s: float | None = None

    @property
    def trace_id(self) -> str:
        return tracing.trace_id_of(self.context)

    def headers(self) -> dict[str, str]:
        """What the response returns: the request's traceparent, when it is traced."""
        return {"traceparent": self.context} if self.context else {}

    def prepared(self, marks: list[tuple[str, int, int]]) -> None:
        """The gateway's phases (name, start, end in time.time_ns()) are done."""
        if marks:
            self.prepare_s = (marks[-1][2] - marks[0][1]) / 1e9
        if self.context:
            for name, start, end in marks:
                tracing.record("gateway", f"gateway.{name}", self.context, start, end)

    def end(self, timings: dict[str, float], attributes: dict | None = None, error: str | None = None) -> None:
        """The response has ended: the span closes with the request's phase times."""
        if self.span is not None:
            phases = {f"pdserve.phase.{k}_ms": round(v * 1000, 3) for k, v in timings.items()}
            tracing.end(self.span, attributes={**phases, **(attributes or {})}, error=error)
            self.span = None


def server_timing(timings: dict[str, float]) -> str:
    """The W3C Server-Timing header of the phase times: `queue;dur=1.2, prefill;dur=30.5, ...` (ms)."""
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in timings.items())
