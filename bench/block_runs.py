"""How many stretches of consecutive blocks a decode reservation spans in a cache that has been
serving a while: least-recently-used blocks (as prefill and decode growth allocate) against the
contiguous allocation a decode instance asks for when KV arrives by transfer. A transfer
receives a part straight into the cache when it spans at most MAX_DIRECT_RUNS stretches.

    python -m bench.block_runs                 # 1,024 and 4,096-token reservations, 20 seeds each
    python -m bench.block_runs --tokens 512 --seeds 50 --json

The churn, per step (16 decode tokens): each running request ends with probability 1/16 (a mean
of 256 generated tokens), every running request grows by one block, and prompts of 1 to
2 x tokens are reserved while they fit, so the cache stays full; then requests end at random
until the measured reservation fits, and it is made.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

from engine.core.block_manager import KVCacheManager
from engine.core.request import Request
from kvtransfer.receiver import MAX_DIRECT_RUNS

BLOCK = 16


def stretches(ids: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))


def churned_reservation(num_blocks: int, tokens: int, contiguous: bool, seed: int, steps: int) -> int:
    """Stretches of a `tokens` reservation after `steps` of churn (reservations `contiguous` or not)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    live: list[Request] = []
    for step in range(steps):
        for req in [r for r in live if rng.random() < 1 / 16]:
            kv.free(req)
            live.remove(req)
        for req in live:  # decode growth takes the least recently used block
            req.num_computed_tokens = len(kv.get_block_ids(req.request_id)[0]) * BLOCK
            kv.allocate_slots(req, BLOCK)
        while True:
            req = Request(f"{step}-{len(live)}", [1] * rng.randint(1, 2 * tokens))
            if kv.allocate_slots(req, req.num_tokens, contiguous=contiguous) is None:
                kv.free(req)
                break
            req.num_computed_tokens = req.num_tokens
            live.append(req)
    while kv.num_free_blocks < tokens // BLOCK:
        kv.free(live.pop(rng.randrange(len(live))))
    req = Request("measured", [1] * tokens)
    kv.allocate_slots(req, tokens, contiguous=contiguous)
    return stretches(kv.get_block_ids("measured")[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.block_runs", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--cache-x", type=int, default=8, help="cache size in multiples of the reservation")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for tokens in args.tokens:
        for contiguous in (False, True):
            runs = [churned_reservation(args.cache_x * tokens // BLOCK + 1, tokens, contiguous, seed, args.steps)
                    for seed in range(args.seeds)]
            rows.append({"tokens": tokens, "allocation": "contiguous" if contiguous else "lru",
                         "median_stretches": statistics.median(runs), "max_stretches": max(runs),
                         "direct_share": sum(r <= MAX_DIRECT_RUNS for r in runs) / len(runs)})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"stretches per reservation after churn, {args.seeds} seeds; direct: <= {MAX_DIRECT_RUNS} stretches")
    print(f"{'tokens':>7} {'allocation':>11} {'median':>7} {'max':>5} {'direct':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['allocation']:>11} {r['median_stretches']:>7} {r['max_stretches']:>5} "
              f"{r['direct_share']:>7.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
