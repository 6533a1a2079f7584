"""A role flip against a cold instance start (issue 55 item 1), in the same run: on a 2P1D cluster on Ray,
the seconds `add_instance("decode")` takes (a new instance: its Ray actor, model load, KV pool, workers), then
the seconds `flip_instance` takes to turn a prefill instance into a decode one and back, idle and under load.

    python -m bench.flip --json
    python -m bench.flip --model smollm2 --flips 3 --load-requests 16
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams

logger = logging.getLogger("bench.flip")


def run(args) -> dict:
    spec = ClusterSpec(model=args.model, num_prefill=2, num_decode=1, max_num_seqs=16)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (i * 13 + k) % 250 for k in range(256)] for i in range(args.load_requests)]  # (any vocabulary)
    out: dict = {"model": args.model, "flips": []}
    with Cluster(spec) as cluster:
        cluster.generate(prompts[:2], params, timeout_s=300)  # warm
        start = time.monotonic()
        added = cluster.add_instance("decode")
        out["cold_start_s"] = round(time.monotonic() - start, 3)
        cluster.remove_instance(added)
        role = "decode"
        for i in range(args.flips):
            for loaded in (False, True):
                streams = [cluster.submit(f"f{i}{loaded}{j}", p, params) for j, p in enumerate(prompts)] if loaded else []
                deadline = time.monotonic() + 10
                while loaded and cluster.router.is_drained("prefill-1") and time.monotonic() < deadline:
                    time.sleep(0.001)  # until requests are on it: the flip drains them
                t = cluster.flip_instance("prefill-1", role)
                ok = all(s.result(300).error is None for s in streams)
                out["flips"].append({"to": role, "loaded": loaded, "ok": ok, **{k: round(v, 3) for k, v in t.items()}})
                role = "prefill" if role == "decode" else "decode"
    for loaded in (False, True):
        rows = [f["total_s"] for f in out["flips"] if f["loaded"] == loaded]
        out[f"flip_{'loaded' if loaded else 'idle'}_median_s"] = round(statistics.median(rows), 3)
    out["rebuild_median_s"] = round(statistics.median(f["rebuild_s"] for f in out["flips"]), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--flips", type=int, default=3, help="flip pairs (to decode and back), idle and loaded each")
    p.add_argument("--load-requests", type=int, default=32, help="requests in flight when a loaded flip starts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
