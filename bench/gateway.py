"""Per-request overhead of the HTTP gateway: the same requests through `POST /v1/completions`
(streaming, the openai client's path: HTTP + tokenize + router + detokenize + SSE) and through
`Cluster.submit` directly (router + instances), at 1 and 64 concurrent streams.

    python -m bench.gateway                  # SmolLM2, 1 prefill + 1 decode in-process, 8 output tokens
    python -m bench.gateway --requests 128 --json

Both paths send the same token ids (the HTTP path as a token-id prompt, so tokenizing cost is not
counted twice) and wait for the last token. Overhead = HTTP latency - direct latency per
percentile; the model's compute is in both.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import threading
import time

import httpx

from bench.offline import random_prompts
from cluster.cli.serve import build, serve_in_thread
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams

logger = logging.getLogger("bench.gateway")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _http_run(url: str, prompts, max_tokens: int, concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8), timeout=600) as http:
        async def one(p):
            async with sem:
                start = time.perf_counter()
                body = {"model": "smollm2", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            break
                return time.perf_counter() - start
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _direct_run(cluster, prompts, max_tokens: int, concurrency: int) -> list[float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    lat: list[float] = []
    lock = threading.Lock()
    todo = list(enumerate(prompts))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, p = todo.pop()
            start = time.perf_counter()
            cluster.submit(f"direct-{time.monotonic_ns()}-{i}", p, params).result(timeout=600)
            with lock:
                lat.append(time.perf_counter() - start)
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def run(args) -> dict:
    spec = ClusterSpec(model="smollm2", dtype=args.dtype, device="cpu", num_threads=2, max_num_seqs=128)
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    out = {"dtype": args.dtype, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "rows": []}
    try:
        warm = random_prompts(4, args.prompt_len, seed=7)
        _direct_run(cluster, warm, args.max_tokens, 4)
        asyncio.run(_http_run(url, warm, args.max_tokens, 4))
        for conc in args.concurrency:
            n = max(args.requests, conc)
            # distinct prompts per path and level: no prefix-cache hit favours either side
            direct = _direct_run(cluster, random_prompts(n, args.prompt_len, seed=1000 + conc), args.max_tokens, conc)
            http = asyncio.run(_http_run(url, random_prompts(n, args.prompt_len, seed=2000 + conc),
                                         args.max_tokens, conc))
            row = {"concurrency": conc, "requests": n}
            for name, xs in (("direct", direct), ("http", http)):
                row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = _pct(xs, 50) * 1e3, _pct(xs, 99) * 1e3
                row[f"{name}_mean_ms"] = statistics.fmean(xs) * 1e3
            row["overhead_p50_ms"] = row["http_p50_ms"] - row["direct_p50_ms"]
            row["overhead_p99_ms"] = row["http_p99_ms"] - row["direct_p99_ms"]
            out["rows"].append(row)
            logger.info("%s", row)
    finally:
        stop()
        cluster.shutdown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per path and level (at least the concurrency)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'conc':>5} {'direct p50':>11} {'http p50':>9} {'+p50':>7} {'direct p99':>11} {'http p99':>9} {'+p99':>7} (ms)")
    for r in result["rows"]:
        print(f"{r['concurrency']:>5} {r['direct_p50_ms']:>11.1f} {r['http_p50_ms']:>9.1f} {r['overhead_p50_ms']:>7.1f} "
              f"{r['direct_p99_ms']:>11.1f} {r['http_p99_ms']:>9.1f} {r['overhead_p99_ms']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
