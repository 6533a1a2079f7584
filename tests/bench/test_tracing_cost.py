"""bench/tracing_cost.py and bench/otlp_sink.py without servers: the flags, each mode's serve flags,
the ratios over rounds, the sample trace, and the sink as a process (SIGTERM writes what it got)."""
from __future__ import annotations

import pytest

from bench import tracing_cost
from bench.otlp_sink import OTLPReceiver
from engine.core import tracing


def measured(tok_s: dict) -> dict:
    """A measure_target result: {neighbours: {client: tok/s}}."""
    return {"levels": {n: {"rows": {c: {"output_tok_s": v, "num_ok": 4} for c, v in clients.items()}}
                       for n, clients in tok_s.items()}}


def test_flags_modes_and_refusals(capsys):
    args = tracing_cost.parse_args(["--rounds", "3", "--modes", "off,100%", "--clients", "ours"])
    assert (args.rounds, args.modes, args.targets, args.neighbours) == (3, ("off", "100%"), ("disaggregated",), (0, 1))
    for bad in (["--modes", "1%,off"], ["--modes", "off,50%"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            tracing_cost.parse_args([*bad, "--clients", "ours"])
        assert "--modes start with off" in capsys.readouterr().err
    one = tracing_cost.mode_args(args, 0.01, "http://127.0.0.1:9")
    assert one.pdserve_arg == ["--otlp-traces-endpoint=http://127.0.0.1:9", "--trace-sample-ratio=0.01"]
    assert tracing_cost.mode_args(args, None, "http://127.0.0.1:9").pdserve_arg == [] == args.pdserve_arg


def test_ratios_are_over_the_rounds_sums():
    rounds = [{"off": measured({"0": {"ours": 100.0}}), "1%": measured({"0": {"ours": 99.0}})},
              {"off": measured({"0": {"ours": 80.0}}), "1%": measured({"0": {"ours": 81.0}})}]
    assert tracing_cost.ratios(rounds, ("off", "1%")) == {"off n0 ours": 1.0, "1% n0 ours": 1.0}


def test_the_sink_takes_real_exports_and_the_sample_trace_reads_them(tmp_path):
    """Spans exported by the OTLP/HTTP exporter reach the receiver decoded; the sample trace is the
    last complete one, in start order, in ms from its first span."""
    receiver = OTLPReceiver()
    try:
        tracing.configure(tracing.TracingConfig(receiver.url))
        root = tracing.start("gateway", "POST /v1/completions", None, 1_000_000_000)
        ctx = tracing.context_of(root)
        for name, role, start in (("prefill.compute", "prefill", 2), ("kv.receive", "decode", 3),
                                  ("decode", "decode", 4)):
            tracing.record(role, name, ctx, 1_000_000_000 + start * 1_000_000, 1_000_000_000 + (start + 1) * 1_000_000)
        tracing.end(root, 1_010_000_000)
        tracing.configure(None)  # flushes every provider
    finally:
        receiver.close()
    sample = tracing_cost.sample_trace([vars(s) for s in receiver.spans])
    assert [(s["name"], s["service"], s["start_ms"], s["ms"]) for s in sample["spans"]] == [
        ("POST /v1/completions", "pdserve-gateway", 0.0, 10.0), ("prefill.compute", "pdserve-prefill", 2.0, 1.0),
        ("kv.receive", "pdserve-decode", 3.0, 1.0), ("decode", "pdserve-decode", 4.0, 1.0)]
    assert tracing_cost.sample_trace([]) is None


def test_the_sink_process_writes_what_it_got_on_sigterm(tmp_path):
    """The bench's sink: listening once start_sink returns; SIGTERM makes it write its rows and exit."""
    proc, url, out = tracing_cost.start_sink(tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:")
        assert tracing_cost.stop_sink(proc, out) == {"posts": 0, "spans": []} and proc.returncode == 0
    finally:
        proc.kill()
