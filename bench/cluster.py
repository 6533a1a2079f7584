"""Disaggregated serving on this machine: how much of TTFT the KV transfer costs, and W1 through
one prefill + one decode instance against one colocated instance on the same cores.

    python -m bench.cluster                      # both parts, SmolLM2, bf16
    python -m bench.cluster --part ttft --prompt-len 1024 --reps 5 --json
    python -m bench.cluster --part w1 --dtype float32

TTFT part: 1P1D, prompts of `prompt_len` random tokens (no prefix hits), one at a time. The
router streams the first token from the prefill instance while the KV is still moving, so the
transfer is not inside TTFT; what it delays is the decode instance's start. Reported per request:
TTFT, the transfer's *exposed* time (first token sampled -> decode acknowledged all KV: what a
design that samples the first token on the decode side would add to TTFT), and its whole duration
(first layer queued -> acknowledged, mostly overlapped with the prefill's compute).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time

from bench.offline import random_prompts
from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams

logger = logging.getLogger("bench.cluster")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def bench_ttft(args) -> dict:
    spec = ClusterSpec(model=args.model, dtype=args.dtype, device="cpu", num_threads=1,
                       max_num_batched_tokens=max(2048, args.prompt_len))
    rows = []
    with Cluster(spec) as c:
        c.generate(random_prompts(1, args.prompt_len, seed=99), _greedy(2))  # warm-up (and the pair group)
        for r in range(args.reps):
            (s,) = c.generate(random_prompts(1, args.prompt_len, seed=100 + r), _greedy(2))
            rows.append({"ttft_s": s.first_token_s - s.arrival_s})
        import ray
        log = ray.get(c.instances["prefill-0"].ranks[0].kv_transfer_log.remote())[-args.reps:]
    for row, t in zip(rows, log):
        row.update(bytes=t["bytes"], exposed_s=t["acked_s"] - t["finish_s"], duration_s=t["acked_s"] - t["begin_s"])
        row.update(exposed_share=row["exposed_s"] / row["ttft_s"], duration_share=row["duration_s"] / row["ttft_s"])
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"prompt_len": args.prompt_len, "reps": args.reps, "rows": rows, "ttft_median_s": med("ttft_s"),
            "exposed_median_s": med("exposed_s"), "duration_median_s": med("duration_s"),
            "exposed_share_median": med("exposed_share"), "duration_share_median": med("duration_share")}


def _w1(spec: ClusterSpec, args) -> dict:
    prompts = random_prompts(args.num_requests, 128, seed=0)
    with Cluster(spec) as c:
        c.generate(random_prompts(2, 128, seed=1), _greedy(4))  # warm-up
        start = time.perf_counter()
        streams = c.generate(prompts, _greedy(128))
        wall = time.perf_counter() - start
    n = sum(len(s.token_ids) for s in streams)
    assert n == len(prompts) * 128 and all(s.error is None for s in streams)
    ttfts = [s.first_token_s - s.arrival_s for s in streams]
    return {"output_tok_s": n / wall, "wall_s": wall, "ttft_median_s": statistics.median(ttfts)}


def bench_w1(args) -> dict:
    """The same 2 cores: colocated gets both threads; 1P1D gives one to each instance."""
    base = dict(model=args.model, dtype=args.dtype, device="cpu", max_num_batched_tokens=2048)
    out = {"num_requests": args.num_requests}
    out["colocated"] = _w1(ClusterSpec(**base, mode="colocated", num_threads=2), args)
    logger.info("colocated: %s", out["colocated"])
    out["disaggregated_1p1d"] = _w1(ClusterSpec(**base, num_threads=1), args)
    logger.info("1P1D: %s", out["disaggregated_1p1d"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["ttft", "w1", "all"], default="all")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    result = {"model": args.model, "dtype": args.dtype}
    with contextlib.redirect_stdout(sys.stderr):
        if args.part in ("ttft", "all"):
            result["ttft"] = bench_ttft(args)
        if args.part in ("w1", "all"):
            result["w1"] = bench_w1(args)
    if args.json:
        print(json.dumps(result))
        return 0
    if "ttft" in result:
        t = result["ttft"]
        print(f"{t['prompt_len']}-token prompts, 1P1D, median of {t['reps']}: TTFT {t['ttft_median_s'] * 1e3:.0f} ms; "
              f"KV transfer exposed {t['exposed_median_s'] * 1e3:.1f} ms ({t['exposed_share_median']:.1%} of TTFT), "
              f"whole {t['duration_median_s'] * 1e3:.0f} ms ({t['duration_share_median']:.1%})")
    if "w1" in result:
        w = result["w1"]
        print(f"W1 ({w['num_requests']} x 128/128): colocated {w['colocated']['output_tok_s']:.1f} tok/s, "
              f"1P1D {w['disaggregated_1p1d']['output_tok_s']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
