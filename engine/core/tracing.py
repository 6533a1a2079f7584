"""OpenTelemetry traces: one trace per request across the gateway, the router, the prefill instance, the
KV transfer and the decode instance (docs/observability.md). Off unless configured (`configure`:
the spec's otlp_traces_endpoint); then every process exports its spans to that OTLP endpoint
(HTTP/protobuf) under its own service name: the gateway's and router's spans as SERVICES["gateway"],
an instance's as its role's.

What crosses a process is a W3C `traceparent` string (`context_of`), carried in the RequestMessage a
router sends an instance (a Ray call), in the KVTransferParams the prefill's ranks get, and in the
KV control channel's `begin` message; "" means "not traced", so an instance never asks more than
`if trace:`. Sampling is decided once, where a trace starts (the gateway: the spec's
trace_sample_ratio, or the client's own traceparent's flag); a trace not sampled propagates "" and
costs nothing further.

An instance records a phase's start and end as it goes (time.time_ns(): the one clock spans take)
and makes its span when the phase ends (`record`), so no span object lives across an engine step.
Spans that other processes' spans hang under (the router's attempt, the prefill's KV transfer) are
opened at their start (`start`) and ended later.

This module is a leaf: it imports nothing of ours, so any floor may use it."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

SERVICES = {"gateway": "pdserve-gateway", "prefill": "pdserve-prefill", "decode": "pdserve-decode",
            "colocated": "pdserve-decode"}
EXPORT_EVERY_MS = 1000  # a process sends what it has at least this often (OpenTelemetry's default: 5000)
OTLP_TRACES_PATH = "/v1/traces"  # appended to an endpoint given without a path (as OTEL_EXPORTER_OTLP_ENDPOINT)


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go and how many traces start sampled (a ratio in (0, 1])."""
    endpoint: str
    sample_ratio: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in (0, 1], got {self.sample_ratio}")
        if urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ValueError(f"otlp_traces_endpoint must be an http(s) URL, got {self.endpoint!r}")

    @property
    def traces_url(self) -> str:
        parts = urlsplit(self.endpoint)
        return self.endpoint if parts.path not in ("", "/") else self.endpoint.rstrip("/") + OTLP_TRACES_PATH


class _State:
    def __init__(self):
        self.config: TracingConfig | None = None
        self.exporter = None  # tests: every service's spans to one exporter, synchronously
        self.providers: dict[str, object] = {}
        self.lock = threading.Lock()


_state = _State()


def configure(config: TracingConfig | None, exporter=None) -> None:
    """Turns tracing on in this process (None: off, spans flushed and dropped). `exporter`: a
    SpanExporter every service's spans go to at once (tests: an in-memory one) instead of OTLP."""
    shutdown()
    _state.config, _state.exporter = config, exporter
    if config is not None:
        logger.info("tracing on: spans to %s, %g of new traces sampled", config.traces_url, config.sample_ratio)


def enabled() -> bool:
    return _state.config is not None


def shutdown() -> None:
    """Flushes and closes every provider of this process."""
    with _state.lock:
        providers, _state.providers = list(_state.providers.values()), {}
    for provider in providers:
        provider.shutdown()


def tracer(role: str):
    """The tracer of this process's `role` (a key of SERVICES), or None when tracing is off."""
    if _state.config is None:
        return None
    with _state.lock:
        provider = _state.providers.get(role)
        if provider is None:
            provider = _state.providers[role] = _provider(SERVICES[role])
    return provider.get_tracer("pdserve")


def _provider(service: str):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    config = _state.config
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    if _state.exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(_state.exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.traces_url),
                                                       schedule_delay_millis=EXPORT_EVERY_MS))
    return provider


def parent_context(traceparent: str | None):
    """The OpenTelemetry context a W3C traceparent names (None: a new trace starts)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def context_of(span) -> str:
    """`span`'s W3C traceparent, or "" when it is not sampled (nothing downstream records)."""
    if span is None or not span.is_recording():
        return ""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) of a traceparent; "" for ""."""
    return traceparent.split("-")[1] if traceparent else ""


def start(role: str, name: str, parent: str | None, start_ns: int | None = None, attributes: dict | None = None,
          server: bool = False):
    """Opens a span of `role`'s service under `parent` (a traceparent; None: a new trace, sampled
    by the ratio). None when tracing is off, or `parent` is "" (not traced)."""
    t = tracer(role)
    if t is None or parent == "":
        return None
    from opentelemetry.trace import SpanKind
    return t.start_span(name, context=parent_context(parent), kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                        attributes=_clean(attributes), start_time=start_ns)


def end(span, end_ns: int | None = None, attributes: dict | None = None, error: str | None = None) -> None:
    """Ends `span` (None: nothing) with more attributes and, for `error`, an error status."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def record(role: str, name: str, parent: str, start_ns: int, end_ns: int, attributes: dict | None = None,
           error: str | None = None) -> str:
    """A finished phase as a span under `parent` (a traceparent; "": not traced, nothing made).
    Returns the span's traceparent ("" when none was made)."""
    span = start(role, name, parent, start_ns, attributes)
    ctx = context_of(span)
    end(span, max(start_ns, end_ns), error=error)
    return ctx


def event(span, name: str, attributes: dict | None = None, at_ns: int | None = None) -> None:
    if span is not None:
        span.add_event(name, _clean(attributes), timestamp=at_ns)


def _clean(attributes: dict | None) -> dict | None:
    """OpenTelemetry takes str, bool, int, float (or lists of one): None values are left out."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
