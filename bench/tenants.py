"""Tenants on one cluster (issue 54), in the same run: an interactive key's time to first token beside a
batch key's flood, with no keys (first come, first served, as before), with keys of one class (fair shares
only) and with classes (interactive 0, batch 10); the share of output a key with few requests gets beside a
key that floods, with and without fair shares; and what the router's queue and the keys' limits add per
request.

    python -m bench.tenants                 # the three servers, then the per-request costs
    python -m bench.tenants --json --flood-s 12 --interactive 8
    python -m bench.tenants --neighbours 1     # beside a busy neighbour process (bench/busy_host.py)

Each mode is a fresh `pdserve serve` (1P1D on Ray, --max-num-seqs 8, so the decode instance fills and the
router queues), driven over HTTP by this process' clients (httpx): the batch flood a closed loop of
`--flood-concurrency` long requests, the interactive client one streamed request every 0.5 s. Two keys
at once with different bearer tokens is what aiperf cannot play, so only our client measures here.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx

from bench.busy_host import busy_neighbours
from bench.serving_vs_vllm import Server, _free_port, server_command

logger = logging.getLogger("bench.tenants")
KEYS = {"chat": "sk-bench-chat-0123456789", "batch": "sk-bench-batch-012345678", "a": "sk-bench-a-0123456789ab",
        "b": "sk-bench-b-0123456789ab"}
MODES = {"fifo": None, "fair": {"chat": 0, "batch": 0}, "classes": {"chat": 0, "batch": 10}}


def keys_file(classes: dict[str, int], folder: Path) -> Path:
    from gateway.api_keys import hash_api_key
    path = folder / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": n, "sha256": hash_api_key(k), "priority": classes.get(n, 0)}
                                         for n, k in KEYS.items()]}))
    return path


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 10000) for _ in range(n)]


async def one(http: httpx.AsyncClient, who: str | None, ids: list[int], max_tokens: int) -> tuple[float, int, float]:
    """(TTFT s, output tokens, end time) of one streamed completion."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {} if who is None else {"Authorization": f"Bearer {KEYS[who]}"}
    start, first, tokens = time.monotonic(), None, 0
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.monotonic() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or math.nan, tokens, time.monotonic()


async def closed_loop(http, tag: str, key: str | None, concurrency: int, prompt_len: int, max_tokens: int, seed: int,
                      done: list):
    """`concurrency` requests of key `key` (None: no key) in flight until cancelled; each end goes
    to `done` as (tag, TTFT, tokens, end)."""
    rng = random.Random(seed)

    async def worker():
        while True:
            done.append((tag, *await one(http, key, prompt(rng, prompt_len), max_tokens)))
    await asyncio.gather(*(worker() for _ in range(concurrency)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


async def interactive_beside_flood(url: str, keyed: bool, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as http:
        rng = random.Random(7)
        quiet = [(await one(http, "chat" if keyed else None, prompt(rng, 48), 16))[0] for _ in range(args.interactive)]
        flood: list = []
        task = asyncio.create_task(closed_loop(http, "batch", "batch" if keyed else None, args.flood_concurrency,
                                               256, 96, 1, flood))
        await asyncio.sleep(args.warmup_s)
        busy = []
        for _ in range(args.interactive):
            busy.append(asyncio.create_task(one(http, "chat" if keyed else None, prompt(rng, 48), 16)))
            await asyncio.sleep(0.5)
        ttfts = [t for t, _, _ in await asyncio.gather(*busy)]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
    return {"quiet_ttft_ms": {"p50": pct(quiet, 0.5), "p99": pct(quiet, 0.99)},
            "flood_ttft_ms": {"p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99)}, "flood_requests_done": len(flood)}


async def share_beside_flood(url: str, keyed: bool, args) -> dict:
    """Key a floods (32 in flight), key b keeps `--b-concurrency` in flight: b's share of the tokens finished
    after the warm-up (its fair share, both keys backlogged: a half)."""
    done: list = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as http:
        start = time.monotonic()
        tasks = [asyncio.create_task(closed_loop(http, who, who if keyed else None, c, 64, 32, seed, done))
                 for who, c, seed in (("a", 32, 2), ("b", args.b_concurrency, 3))]
        await asyncio.sleep(args.flood_s)
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await asyncio.gather(*tasks, return_exceptions=True)
    window = [(who, n) for who, _, n, end in done if end - start >= args.warmup_s]
    tokens = {w: sum(n for who, n in window if who == w) for w in ("a", "b")}
    return {"tokens": tokens, "b_share": round(tokens["b"] / max(1, sum(tokens.values())), 3)}


def measure_mode(mode: str, args, folder: Path) -> dict:
    port = _free_port()
    extra = [] if MODES[mode] is None else [f"--api-keys-file={keys_file(MODES[mode], folder)}"]
    args.pdserve_arg = ["--num-prefill=1", "--num-decode=1", "--max-num-seqs=8", "--router-queue-timeout-s=600",
                        *extra]
    argv, env, ready = server_command("pdserve", port, args)
    server = Server(mode, argv, env, f"http://127.0.0.1:{port}", folder / f"{mode}.log")
    try:
        server.wait_ready(ready, 300)
        keyed = MODES[mode] is not None
        with busy_neighbours(args.neighbours):  # (started once the server is up: its load is not measured)
            out = {"interactive": asyncio.run(interactive_beside_flood(server.url, keyed, args))}
            if mode != "classes":  # a and b are of one class there too: "fair" measures it
                out["share"] = asyncio.run(share_beside_flood(server.url, keyed, args))
        return out
    finally:
        server.stop()


def per_request_costs(n: int = 20000, repeats: int = 5) -> dict:
    """Microseconds per request, the least of `repeats` runs: the router's queue (push + pop, `n` queued)
    against a plain deque, with 1 and 100 tenants; the keys' limits (admit + charge + release) held
    locally, and in Redis when redis-server is here."""
    from engine.core.request import SamplingParams
    from router.flow import FlowQueue
    from router.tables import RequestStream, Tracked
    reqs = {t: [Tracked(str(i), [1] * 64, SamplingParams(max_tokens=32), RequestStream(str(i)), tenant=f"k{i % t}")
                for i in range(n)] for t in (1, 100)}

    def timed(queue_of, push, pop, rs) -> float:
        best = math.inf
        for _ in range(repeats):
            q = queue_of()
            start = time.perf_counter()
            for r in rs:
                push(q, r)
            while q:
                pop(q)
            best = min(best, time.perf_counter() - start)
        return round(best / len(rs) * 1e6, 3)
    out = {"deque_us": timed(deque, deque.append, deque.popleft, reqs[1])}
    for t, rs in reqs.items():
        out[f"flow_queue_{t}_tenants_us"] = timed(FlowQueue, FlowQueue.push, FlowQueue.pop, rs)
    out.update(asyncio.run(_limit_costs()))
    return out


async def _limit_costs(n: int = 2000) -> dict:
    from gateway.api_keys import APIKey, hash_api_key
    from gateway.limits import KeyLimits
    key = APIKey("k", hash_api_key("x" * 16), requests_per_second=1e9, burst=10**9, max_concurrent=10**6,
                 token_budget=10**12)
    out = {}
    with _redis() as shared:
        for name, limits in (("limits_local_us", KeyLimits()), ("limits_redis_us", KeyLimits(shared))):
            if name == "limits_redis_us" and shared is None:
                continue
            start = time.perf_counter()
            for _ in range(n):
                hold = await limits.admit(key)
                await limits.charge(hold, 100)
                await limits.release(hold)
            await asyncio.sleep(0.1)  # (the releases' tasks)
            out[name] = round((time.perf_counter() - start - 0.1) / n * 1e6, 1)
    return out


@contextlib.contextmanager
def _redis():
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    from cluster.cli.serve import shared_limits
    from tests.conftest import _start_redis, stop_server
    with tempfile.TemporaryDirectory() as d:
        proc, port = _start_redis(binary, d)
        try:
            yield shared_limits(f"redis://127.0.0.1:{port}/0")
        finally:
            stop_server(proc)


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        modes = {mode: measure_mode(mode, args, Path(d)) for mode in MODES}
    return {"modes": modes, "per_request": per_request_costs(),
            "settings": {k: getattr(args, k) for k in ("flood_s", "interactive", "flood_concurrency", "warmup_s",
                                                         "neighbours", "b_concurrency")}}


def table(r: dict) -> str:
    lines = ["| mode | quiet TTFT p50/p99 ms | beside flood p50/p99 ms | b's share beside a's flood |", "|---|---|---|---|"]
    for mode, m in r["modes"].items():
        i = m["interactive"]
        share = m.get("share", {}).get("b_share", "")
        lines.append(f"| {mode} | {i['quiet_ttft_ms']['p50']} / {i['quiet_ttft_ms']['p99']} | "
                     f"{i['flood_ttft_ms']['p50']} / {i['flood_ttft_ms']['p99']} | {share} |")
    return "\n".join(lines) + "\n\nper request: " + json.dumps(r["per_request"])


def main(argv: list[str] | None = None) -> int:
    from bench.serving_vs_vllm import run_main
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--flood-s", type=float, default=20.0, help="the share measurement's length")
    p.add_argument("--interactive", type=int, default=12, help="interactive requests, quiet and beside the flood")
    p.add_argument("--flood-concurrency", type=int, default=24)
    p.add_argument("--b-concurrency", type=int, default=8, help="key b's requests in flight beside key a's 32")
    p.add_argument("--warmup-s", type=float, default=4.0, help="flood time before measuring")
    p.add_argument("--neighbours", type=int, default=0, help="busy-loop processes beside the server (a host not idle)")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    args.quantization, args.attention_backend, args.convert_to = "auto", "auto", None
    return run_main(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
