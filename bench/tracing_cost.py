"""What tracing costs a 1P1D server: output tok/s with tracing off, on at 1% and at 100% sampling, in the
same run, with our load generator and aiperf, on a quiet host and beside a busy neighbour; and one
traced request's phase breakdown, from the spans an OTLP receiver got.

    python -m bench.tracing_cost                       # 2 rounds of off, 1%, 100%; 0 and 1 neighbours; both clients
    python -m bench.tracing_cost --json --rounds 1 --clients ours --neighbours 0 --num-requests 16

Each mode of each round is a fresh `pdserve serve` (1P1D, Ray) measured as bench/busy_host.py measures a
target (the same flags: workload, neighbours, clients, aiperf's). The traced modes send their spans to
an OTLP/HTTP receiver (bench/otlp_sink.py) in a process of its own, as a collector beside the server
would take them. Rounds alternate the modes' order (off first, then off last, ...), so a drift of
the host over the run hits each mode alike.
`ratio` = a mode's tok/s over tracing off's, per client and neighbour count, over the rounds' sums.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.busy_host import measure_target
from bench.busy_host import parse_args as busy_args
from bench.serving_vs_vllm import REPO, _free_port, run_main

logger = logging.getLogger("bench.tracing_cost")
MODES = {"off": None, "1%": 0.01, "100%": 1.0}


def start_sink(log_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    port, out = _free_port(), log_dir / "spans.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", "--port", str(port), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=open(log_dir / "sink.log", "wb"))
    deadline = time.monotonic() + 60
    while True:  # listening before any server picks a free port (it might pick this one)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}", out
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OTLP sink did not start (log {log_dir / 'sink.log'})") from None
            time.sleep(0.1)


def stop_sink(proc: subprocess.Popen, out: Path) -> dict:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return json.loads(out.read_text())


def mode_args(args: argparse.Namespace, ratio: float | None, endpoint: str) -> argparse.Namespace:
    run = copy.copy(args)
    run.pdserve_arg = list(args.pdserve_arg)
    if ratio is not None:
        run.pdserve_arg += [f"--otlp-traces-endpoint={endpoint}", f"--trace-sample-ratio={ratio:g}"]
    return run


def sample_trace(spans: list[dict]) -> dict | None:
    """The phase breakdown (ms per span name, in start order) of the last trace that has every span."""
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    complete = [t for t in by_trace.values() if {"kv.receive", "decode", "prefill.compute"} <= {s["name"] for s in t}]
    if not complete:
        return None
    trace = sorted(complete[-1], key=lambda s: s["start_ns"])
    t0 = trace[0]["start_ns"]
    return {"trace_id": trace[0]["trace_id"],
            "spans": [{"name": s["name"], "service": s["service"], "start_ms": round((s["start_ns"] - t0) / 1e6, 3),
                       "ms": round((s["end_ns"] - s["start_ns"]) / 1e6, 3)} for s in trace]}


def run(args: argparse.Namespace) -> dict:
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tracing_cost-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    sink, endpoint, out = start_sink(args.log_dir)
    rounds = []
    try:
        for r in range(args.rounds):
            modes = {}
            for name in args.modes if r % 2 == 0 else reversed(args.modes):  # a drift of the host hits each alike
                run_args = mode_args(args, MODES[name], endpoint)
                run_args.log_dir = args.log_dir / f"round{r}-{name.rstrip('%')}"
                run_args.log_dir.mkdir(exist_ok=True)
                modes[name] = measure_target("disaggregated", run_args)
                logger.info("round %d, tracing %s: %s", r, name, json.dumps(summary(modes[name])))
            rounds.append(modes)
    finally:
        received = stop_sink(sink, out)
    return {"workload": {"num_requests": args.workload.num_requests, "concurrency": args.workload.concurrency,
                         "prompt_tokens": args.workload.num_prompt_tokens,
                         "output_tokens": args.workload.num_output_tokens, "dtype": args.dtype},
            "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "loadavg_1m_at_end": os.getloadavg()[0]},
            "rounds": [{m: summary(v) for m, v in modes.items()} for modes in rounds],
            "ratios": ratios(rounds, args.modes), "spans_received": len(received["spans"]),
            "services": sorted({s["service"] for s in received["spans"]}),
            "sample_trace": sample_trace(received["spans"]),
            "log_dir": str(args.log_dir)}


def summary(measured: dict) -> dict:
    """{neighbours: {client: (tok/s, TTFT p50 s, ok, failed)}} of one server."""
    return {n: {c: {k: row.get(k) for k in ("output_tok_s", "ttft_p50_s", "num_ok", "num_failed")}
                for c, row in level["rows"].items()} for n, level in measured["levels"].items()}


def ratios(rounds: list[dict], modes) -> dict:
    """Per mode, neighbour count and client: its tok/s summed over the rounds over tracing off's."""
    out = {}
    for mode in modes:  # (a round's modes in any order)
        for n, clients in rounds[0][mode]["levels"].items():
            for client in clients["rows"]:
                got = [r[mode]["levels"][n]["rows"][client]["output_tok_s"] for r in rounds]
                off = [r["off"]["levels"][n]["rows"][client]["output_tok_s"] for r in rounds]
                if None not in got + off and sum(off):
                    out[f"{mode} n{n} {client}"] = round(sum(got) / sum(off), 3)
    return out


def format_table(result: dict) -> str:
    lines = ["| mode, neighbours, client | tok/s over tracing off |", "| --- | --- |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["ratios"].items()]
    return "\n".join(lines) + f"\n\nspans received: {result['spans_received']} ({', '.join(result['services'])})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_cost", add_help=False)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="off,1%,100%", help=f"comma-separated, of {', '.join(MODES)} (off first)")
    own, rest = p.parse_known_args(argv)
    modes = tuple(m.strip() for m in own.modes.split(","))
    if own.rounds < 1 or not modes or modes[0] != "off" or any(m not in MODES for m in modes):
        p.error(f"--rounds must be >= 1 and --modes start with off, of {', '.join(MODES)}; got {own.modes!r}")
    args = busy_args(["--targets", "disaggregated", "--neighbours", "0,1", *rest])
    args.rounds, args.modes = own.rounds, modes
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, format_table)


if __name__ == "__main__":
    sys.exit(main())
