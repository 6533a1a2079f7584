"""Does disaggregation pay? The same mixed workload, on the same cores, against two clusters:
colocated (two instances, each prefilling and decoding) and 1P1D (one prefill, one decode
instance; also with conditional disaggregation, prompts under 256 tokens prefilled on the
decode instance), each rank on one thread, through the HTTP gateway.
`python -m bench.disagg_vs_colocated --duration 120 --out bench/results/disagg_vs_colocated`

Workload: chat-like requests (short prompt, long answer) arrive as a Poisson stream with long
prompts (short answer) mixed in: every long prompt's prefill lands among running decodes. The
colocated instance runs that prefill inside its decode batch, stalling every stream it holds;
the decode instance of 1P1D never computes a prompt. Reported per cluster: TTFT, TBT (per
request mean) and inter-token gap percentiles, throughput, and goodput under the SLOs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
from pathlib import Path

from cluster.cli.serve import build, serve_in_thread
from cluster.loadgen.loadgen import LoadConfig, run_load
from cluster.loadgen.loadgen_report import Slo, inter_chunk_gaps, summarize
from cluster.spec import ClusterSpec


def write_dataset(path: Path, n: int, short: tuple[int, int], long: tuple[int, int], long_every: int,
                  seed: int = 0) -> None:
    """JSONL of token-id prompts: one (long prompt, short answer) every `long_every` requests."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt_len, output = long if i % long_every == long_every - 1 else short
            f.write(json.dumps({"prompt": [rng.randrange(100, 20000) for _ in range(prompt_len)],
                                "output_tokens": output}) + "\n")


def run_one(name: str, spec: ClusterSpec, dataset: Path, rate: float, duration_s: float, slo: Slo) -> dict:
    """The cluster and gateway in this process, the load generator against them."""
    cluster, app = build(spec)
    url, stop = serve_in_thread(app)
    try:
        result = asyncio.run(run_load(LoadConfig(url=url, dataset=str(dataset), rate=rate, arrival="poisson",
                                                 duration_s=duration_s, progress=False, seed=1)))
        cluster.assert_no_leaks()
    finally:
        stop()
        cluster.shutdown()
    summary = summarize(result.records, slo)
    summary["name"] = name
    summary["gaps"] = inter_chunk_gaps(result.records)
    summary["ttfts"] = [r.ttft_s for r in result.records if r.ttft_s is not None]
    return summary


def plot(results: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for ax, key in zip(axes, ("gaps", "ttfts")):
            xs = sorted(r[key])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["name"])
    for ax, title in zip(axes, ("inter-token gap (s)", "TTFT (s)")):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cdf.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per cluster")
    ap.add_argument("--rate", type=float, default=0.6, help="requests/s, long prompts included")
    ap.add_argument("--short", type=int, nargs=2, default=(32, 96), metavar=("PROMPT", "OUTPUT"))
    ap.add_argument("--long", type=int, nargs=2, default=(1024, 8), metavar=("PROMPT", "OUTPUT"))
    ap.add_argument("--long-every", type=int, default=5, help="one long prompt in this many requests")
    ap.add_argument("--ttft-slo", type=float, default=8.0)
    ap.add_argument("--tbt-slo", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="folder for result.json and cdf.png")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = dict(model=args.model, dtype="float32", device="cpu", num_threads=1, kv_memory_gib=0.5,
                max_num_seqs=64, max_num_batched_tokens=2048)
    clusters = {"colocated (2 instances)": ClusterSpec(mode="colocated", num_decode=2, **base),
                "1P1D": ClusterSpec(num_prefill=1, num_decode=1, **base),
                # conditional disaggregation: short prompts are prefilled on the decode instance
                "1P1D, short local": ClusterSpec(num_prefill=1, num_decode=1, disagg_threshold_tokens=256, **base)}
    slo = Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "mixed.jsonl"
        write_dataset(dataset, 1000, tuple(args.short), tuple(args.long), args.long_every)
        results = [run_one(name, spec, dataset, args.rate, args.duration, slo) for name, spec in clusters.items()]
    print(f"{'cluster':<26}{'ok':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p50':>9}{'TBT p99':>9}{'gap p99':>9}"
          f"{'tok/s':>8}{'goodput':>9}{'SLO met':>9}")
    for r in results:
        print(f"{r['name']:<26}{r['num_ok']:>5}{r['ttft_s']['p50']:>9.2f}s{r['ttft_s']['p99']:>9.2f}s"
              f"{r['tbt_s']['p50']:>8.3f}s{r['tbt_s']['p99']:>8.3f}s{r['inter_chunk_s']['p99']:>8.2f}s"
              f"{r['output_token_throughput']:>8.1f}{r['goodput']:>8.3f}/s{r['slo_attainment']:>9.1%}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"args": vars(args), "results": [
            {k: v for k, v in r.items() if k not in ("gaps", "ttfts")} for r in results]}, indent=1))
        plot(results, out)


if __name__ == "__main__":
    main()
