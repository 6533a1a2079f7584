"""Soak: many requests with random client aborts through a 1P1D cluster in this process; at the
end every allocator must be full and memory must not have grown.
`python -m bench.soak --requests 1000 --model smollm2`

Requests arrive in waves of `--concurrency`; a random `--abort-fraction` of them is aborted at a
random moment (what the gateway does when a client disconnects). RSS is read after a warm-up wave
and again at the end, after garbage collection.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import threading
import time
from pathlib import Path

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _wave(cluster: Cluster, start: int, n: int, rng: random.Random, abort_fraction: float,
          vocab: int, max_tokens: int) -> dict[str, int]:
    streams, timers = [], []
    for i in range(start, start + n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 120))]
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), temperature=rng.choice([0.0, 0.8]),
                                seed=i, ignore_eos=True)
        rid = f"soak-{i}"
        streams.append(cluster.submit(rid, prompt, params))
        if rng.random() < abort_fraction:
            timers.append(threading.Timer(rng.uniform(0.0, 0.5), cluster.abort, args=(rid,)))
            timers[-1].start()
    for t in timers:
        t.join()
    counts = {"finished": 0, "aborted": 0, "error": 0}
    for s in streams:
        s.result(timeout=300)
        counts["aborted" if s.finish_reason == "abort" else "error" if s.error else "finished"] += 1
    return counts


def soak(spec: ClusterSpec, num_requests: int, concurrency: int = 50, abort_fraction: float = 0.3,
         max_tokens: int = 24, seed: int = 0) -> dict:
    """Runs the soak; returns counts, RSS before/after (MiB) and seconds. Raises if a block leaked."""
    rng = random.Random(seed)
    with Cluster(spec, use_ray=False) as cluster:
        vocab = 256 if spec.model != "smollm2" else 40000
        _wave(cluster, -concurrency, concurrency, rng, abort_fraction, vocab, max_tokens)  # warm-up
        gc.collect()
        before, start = rss_mib(), time.monotonic()
        totals = {"finished": 0, "aborted": 0, "error": 0}
        trace = []  # RSS after each wave: growth that keeps going is a leak, a plateau is the allocator
        for first in range(0, num_requests, concurrency):
            counts = _wave(cluster, first, min(concurrency, num_requests - first), rng, abort_fraction, vocab,
                           max_tokens)
            totals = {k: totals[k] + counts[k] for k in totals}
            trace.append(round(rss_mib(), 1))
        seconds = time.monotonic() - start
        cluster.assert_no_leaks()
        gc.collect()
        return {**totals, "requests": num_requests, "rss_before_mib": round(before, 1),
                "rss_after_mib": round(rss_mib(), 1), "rss_by_wave_mib": trace, "seconds": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--abort-fraction", type=float, default=0.3)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    spec = ClusterSpec(model=args.model, dtype="float32", device="cpu", num_kv_blocks=512, block_size=16,
                       max_num_seqs=64, max_num_batched_tokens=1024, num_threads=1)
    print(json.dumps(soak(spec, args.requests, args.concurrency, args.abort_fraction), indent=1))


if __name__ == "__main__":
    main()
