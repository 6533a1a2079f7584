"""The load generator's report: latency percentiles, throughput and goodput from the request
records of `cluster/loadgen/loadgen.py`, a compact table, and `result.json` with two PNG plots."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cluster.loadgen.loadgen import LoadResult, RequestRecord


@dataclass(frozen=True)
class Slo:
    """Goodput targets; None: no target on that latency."""
    ttft_s: float | None = None
    tbt_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        """An ok request whose TTFT and mean TBT are within the targets (a single-token request has no TBT)."""
        if not r.ok:
            return False
        ttft_ok = self.ttft_s is None or (r.ttft_s is not None and r.ttft_s <= self.ttft_s)
        return ttft_ok and (self.tbt_s is None or r.tbt_s is None or r.tbt_s <= self.tbt_s)


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99]).tolist()
    return {"mean": float(a.mean()), "p50": p50, "p90": p90, "p99": p99, "max": float(a.max())}


def in_flight(records: list[RequestRecord]) -> tuple[list[float], list[int]]:
    """(time, requests in flight from then) at each send and end; an end at the same instant as a
    send counts first."""
    events = sorted([(r.send_s, 1) for r in records if r.send_s is not None]
                    + [(r.end_s, -1) for r in records if r.end_s is not None])
    counts = np.cumsum([d for _, d in events]).tolist() if events else []
    return [t for t, _ in events], counts


def inter_chunk_gaps(records: list[RequestRecord]) -> list[float]:
    """Gaps between consecutive text chunks of each ok request, all requests together."""
    return [b - a for r in records if r.ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]


def summarize(records: list[RequestRecord], slo: Slo | None = None) -> dict:
    """Counts, duration (first arrival to last end), throughput, latency stats and goodput.

    Returns:
        a JSON-ready dict; latency stats are {"mean", "p50", "p90", "p99", "max"} in seconds, or
        None without data. `goodput` is requests/s meeting `slo` (without targets: every ok
        request); `slo_attainment` is their fraction of all requests, failed ones included.
    """
    slo = slo or Slo()
    ok = [r for r in records if r.ok]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) - min(r.arrival_s for r in records) if ends else 0.0

    def per_s(n: int) -> float:
        return n / duration if duration > 0 else 0.0

    num_met = sum(slo.met(r) for r in records)
    num_output = sum(r.num_completion_tokens or 0 for r in ok)
    num_input = sum(r.num_prompt_tokens or 0 for r in ok)
    return {
        "num_requests": len(records), "num_ok": len(ok), "num_failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if not r.ok).most_common()),
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(num_output), "input_token_throughput": per_s(num_input),
        "num_output_tokens": num_output, "num_input_tokens": num_input,
        "max_in_flight": max(in_flight(records)[1], default=0),
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_s": _stats([r.tbt_s for r in ok if r.tbt_s is not None]),
        "inter_chunk_s": _stats(inter_chunk_gaps(records)),
        "e2e_s": _stats([r.e2e_s for r in ok]),
        "slo": asdict(slo), "goodput": per_s(num_met), "slo_attainment": num_met / len(records) if records else 0.0,
    }


def format_table(s: dict) -> str:
    """The summary as a few aligned lines (latencies in ms)."""
    slo = ", ".join(f"{k.removesuffix('_s').upper()} <= {v * 1000:.0f} ms"
                    for k, v in s["slo"].items() if v is not None)
    lines = [f"requests  {s['num_ok']} ok, {s['num_failed']} failed in {s['duration_s']:.2f} s",
             f"throughput  {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
             f"{s['input_token_throughput']:.1f} input tok/s; max {s['max_in_flight']} in flight",
             f"goodput  {s['goodput']:.2f} req/s ({s['slo_attainment']:.1%} of requests; {slo or 'no SLO'})",
             f"{'ms':<14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}"]
    for name, key in (("TTFT", "ttft_s"), ("TBT", "tbt_s"), ("inter-chunk", "inter_chunk_s"), ("end-to-end", "e2e_s")):
        st = s[key]
        cells = "".join(f"{st[p] * 1000:>9.1f}" for p in ("mean", "p50", "p90", "p99")) if st else f"{'-':>9}" * 4
        lines.append(f"{name:<14}{cells}")
    lines += [f"failed x{n}: {reason}" for reason, n in list(s["errors"].items())[:5]]
    return "\n".join(lines)


def _jsonable(x):
    """inf -> "inf" (JSON has no infinity), recursively."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return [_jsonable(v) for v in x] if isinstance(x, list) else x


def write_outputs(result: LoadResult, summary: dict, out_dir: str | Path) -> list[Path]:
    """Writes `result.json` (config without the key, summary, per-request records), `latency_cdf.png`
    and `timeline.png` into `out_dir` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(result.config).items() if k != "api_key"}
    doc = {"model": result.model, "started_at": result.started_at, "config": config, "summary": summary,
           "requests": [r.to_dict() for r in result.records]}
    paths = [out / "result.json", out / "latency_cdf.png", out / "timeline.png"]
    paths[0].write_text(json.dumps(_jsonable(doc), indent=1))
    plot_latency_cdf(result.records, summary["slo"], paths[1])
    plot_timeline(result.records, paths[2])
    return paths


def plot_latency_cdf(records: list[RequestRecord], slo: dict, path: Path) -> None:
    """CDFs of TTFT, TBT (per request, and the inter-chunk gaps) and end-to-end latency."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry
    ok = [r for r in records if r.ok]
    panels = [("TTFT", {"per request": [r.ttft_s for r in ok if r.ttft_s is not None]}, slo.get("ttft_s")),
              ("TBT", {"per request (mean)": [r.tbt_s for r in ok if r.tbt_s is not None],
                       "inter-chunk gaps": inter_chunk_gaps(records)}, slo.get("tbt_s")),
              ("end-to-end", {"per request": [r.e2e_s for r in ok]}, None)]
    fig = Figure(figsize=(13, 4), layout="constrained")
    for ax, (title, series, target) in zip(fig.subplots(1, 3), panels):
        for label, xs in series.items():
            if xs:
                x = np.sort(np.asarray(xs)) * 1000
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{label} (n={len(x)})")
        if target is not None:
            ax.axvline(target * 1000, color="red", linestyle=":", label=f"SLO {target * 1000:.0f} ms")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100)


def plot_timeline(records: list[RequestRecord], path: Path) -> None:
    """One row per request: waiting (arrival -> send), to first token, decoding (-> end), failures
    in red; below it, requests in flight."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    sent = [r for r in records if r.send_s is not None and r.end_s is not None]
    first = [r.chunk_s[0] if r.ok and r.chunk_s else r.end_s for r in sent]
    ys = [r.index for r in sent]
    top.hlines(ys, [r.arrival_s for r in sent], [r.send_s for r in sent], color="0.75", lw=1,
               label="waiting for a slot")
    top.hlines(ys, [r.send_s for r in sent], first, color="tab:orange", lw=2, label="to first token")
    top.hlines(ys, first, [r.end_s for r in sent], color="tab:blue", lw=2, label="decoding")
    failed = [r for r in sent if not r.ok]
    if failed:
        top.plot([r.end_s for r in failed], [r.index for r in failed], "rx", label="failed")
    top.set(ylabel="request", title=f"{len(records)} requests")
    top.legend(loc="upper left", fontsize=8)
    times, counts = in_flight(records)
    bottom.step([0.0, *times], [0, *counts], where="post")
    bottom.set(xlabel="seconds since start", ylabel="in flight")
    bottom.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
