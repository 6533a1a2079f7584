"""A request's trace end to end (engine/core/tracing.py, gateway/trace.py) on the shared 1P1D server (SmolLM2,
in-process: its gateway, router, prefill and decode instances each export under their own service name).
Spans go to an in-memory exporter here; tests/cluster/control/test_ray_cluster.py sends them from Ray actors
to an OTLP receiver."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.core import tracing
from cluster.cli.serve import gateway_tokenizer, serve_in_thread
from gateway.app import create_app

pytestmark = pytest.mark.timeout(120)
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
# each span's parent, by name, and the service that made it
SHAPE = {"POST /v1/chat/completions": (None, "pdserve-gateway"),
         "gateway.parse": ("POST /v1/chat/completions", "pdserve-gateway"),
         "gateway.template": ("POST /v1/chat/completions", "pdserve-gateway"),
         "gateway.tokenize": ("POST /v1/chat/completions", "pdserve-gateway"),
         "router.queue": ("POST /v1/chat/completions", "pdserve-gateway"),
         "router.attempt": ("POST /v1/chat/completions", "pdserve-gateway"),
         "prefill.queue": ("router.attempt", "pdserve-prefill"),
         "prefill.compute": ("router.attempt", "pdserve-prefill"),
         "kv.transfer": ("router.attempt", "pdserve-prefill"),
         "kv.receive": ("kv.transfer", "pdserve-decode"),
         "decode.kv_wait": ("router.attempt", "pdserve-decode"),
         "decode": ("router.attempt", "pdserve-decode")}
PHASES = {"prepare", "queue", "prefill_queue", "prefill", "kv_transfer", "decode", "ttft", "e2e"}


@pytest.fixture(scope="module")
def timed(server):
    """A second gateway over the shared server's cluster that returns each answer's phase times."""
    cluster, _ = server
    app = create_app(cluster, gateway_tokenizer(cluster.spec), cluster.spec.model, None, return_timings=True)
    url, stop = serve_in_thread(app)
    yield url
    stop()


def trace_of(exporter, trace_id: int, last: str = "kv.transfer", timeout_s: float = 30.0) -> list:
    """The finished spans of one trace, once `last` (the prefill's transfer span ends at the decode's ack,
    which may come after the answer) is among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if any(s.name == last for s in got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_one_trace_covers_every_phase(timed, spans):
    """One chat request: one trace whose spans cover the gateway's parse, template and tokenize, the
    router's queue and attempt, the prefill's queue and compute, the KV transfer on both ends and the
    decode's wait and decode, each under the right parent (the receive's under the transfer's: its
    context crossed the KV control channel) and service; the answer returns the trace's traceparent,
    its phase times (usage and Server-Timing), and the phase histograms' exemplars carry its trace id."""
    r = httpx.post(f"{timed}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    version, trace_hex, span_hex, flags = r.headers["traceparent"].split("-")
    got = trace_of(spans, int(trace_hex, 16))
    by_name = {s.name: s for s in got}
    assert sorted(by_name) == sorted(SHAPE) and len(got) == len(SHAPE), [s.name for s in got]
    for name, (parent, service) in SHAPE.items():
        span = by_name[name]
        assert span.resource.attributes["service.name"] == service, name
        want = by_name[parent].context.span_id if parent else None
        assert (span.parent.span_id if span.parent else None) == want, name
        assert span.end_time >= span.start_time, name
    root = by_name["POST /v1/chat/completions"]
    assert f"{root.context.span_id:016x}" == span_hex and root.attributes["gen_ai.usage.completion_tokens"] == 4
    assert by_name["router.attempt"].attributes["pdserve.decode_instance"].startswith("decode")
    assert by_name["kv.receive"].attributes["pdserve.kv_bytes"] > 0
    assert by_name["decode"].attributes["pdserve.output_tokens"] == 4
    timings = r.json()["usage"]["timings"]
    assert set(timings) == PHASES and all(v >= 0 for v in timings.values()), timings
    assert timings["e2e"] >= timings["ttft"] > 0
    assert {part.split(";")[0] for part in r.headers["server-timing"].split(", ")} == PHASES
    metrics = httpx.get(f"{timed}/metrics", headers={"Accept": "application/openmetrics-text"}).text
    for histogram in ("pdserve_request_phase_seconds", "pdserve_time_to_first_token_seconds",
                      "pdserve_e2e_request_latency_seconds"):
        assert any(line.startswith(f"{histogram}_bucket") and f'trace_id="{trace_hex}"' in line
                   for line in metrics.splitlines()), histogram


def test_a_client_traceparent_is_continued_on_a_stream(timed, spans):
    """A client's sampled traceparent: the request's spans join its trace under its span; a stream
    returns the traceparent at once and its phase times in the usage chunk."""
    trace_hex, parent_hex = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{timed}/v1/chat/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{trace_hex}-{parent_hex}-01"}) as r:
        assert r.status_code == 200 and r.headers["traceparent"].split("-")[1] == trace_hex
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert set(chunks[-1]["usage"]["timings"]) == PHASES
    got = trace_of(spans, int(trace_hex, 16))
    root = next(s for s in got if s.name == "POST /v1/chat/completions")
    assert f"{root.parent.span_id:016x}" == parent_hex and {s.name for s in got} == set(SHAPE)


def test_tracing_off_makes_no_span(timed):
    """Tracing off (no endpoint): no span anywhere, no traceparent returned (a client's is not
    echoed), and the phase times are still measured."""
    exporter = InMemorySpanExporter()
    tracing.configure(None, exporter)
    r = httpx.post(f"{timed}/v1/chat/completions", json=CHAT, timeout=60,
                   headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert r.status_code == 200 and "traceparent" not in r.headers
    time.sleep(0.5)  # the KV transfer's ack
    assert exporter.get_finished_spans() == () and set(r.json()["usage"]["timings"]) == PHASES


def test_a_refused_request_ends_its_span_with_the_error(timed, spans):
    """A request the gateway refuses (an unknown model: 404) still ends its trace: its span holds the error."""
    r = httpx.post(f"{timed}/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=60)
    assert r.status_code == 404
    root, = [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert root.status.status_code.name == "ERROR" and "nope" in root.status.description


def test_the_spec_turns_timings_on_for_the_gateways_it_builds():
    """`--return-timings` (the spec's) reaches create_app through every gateway the CLI builds."""
    from cluster.cli.serve import gateway_access
    from cluster.spec import ClusterSpec
    assert gateway_access(ClusterSpec(return_timings=True), None)["return_timings"] is True
    assert gateway_access(ClusterSpec(), None)["return_timings"] is False


def test_n_choices_share_one_trace_and_each_decode_is_a_span(timed, spans):
    """n = 2: one prompt prefilled once (one prefill.compute, one kv.transfer), forked on the decode
    instance: a decode span per choice, all in the request's trace under its one attempt."""
    r = httpx.post(f"{timed}/v1/chat/completions", json={**CHAT, "n": 2, "temperature": 1.0, "seed": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    got = trace_of(spans, int(r.headers["traceparent"].split("-")[1], 16))
    names = sorted(s.name for s in got)
    assert names.count("decode") == 2 and names.count("prefill.compute") == names.count("kv.transfer") == 1
    attempt, = [s for s in got if s.name == "router.attempt"]
    assert all(s.parent.span_id == attempt.context.span_id for s in got if s.name == "decode")
    assert set(r.json()["usage"]["timings"]) == PHASES
