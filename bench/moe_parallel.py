"""Expert parallelism against tensor parallelism at 2 ranks, and a placement plan on a skewed routing.

    python -m bench.moe_parallel                 # 2 gloo processes, 1 thread each
    python -m bench.moe_parallel --json --reps 10

One sparse layer (engine/layers/moe.py: `--experts` experts of `--expert-width`, top `--top-k`) on two
ranks, fed the same tokens and routing on both, timed per call with its all-reduce, for:
- tp: each rank holds half of every expert;
- ep: each rank holds half the experts, whole (the default contiguous runs);
- ep_planned: the placement `plan` makes from the routing's counts (engine/core/expert_placement.py);
- ep_planned_replicas: the same with `--replicas` extra copies of the hottest experts.
Two routings: uniform, and skewed (expert e chosen with weight 1 / (e + 1) ** `--skew`, so the
first rank's contiguous run takes most tokens). Per layout: ms per call (the slower rank's, as the
all-reduce waits for it), each rank's expert compute alone, and the ranks' imbalance (max over
mean) counted from the routing and timed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch

from engine.core.config import ModelConfig, MoEConfig
from engine.core.expert_placement import ExpertPlacement, imbalance, plan, rank_loads

LAYOUTS = ("tp", "ep", "ep_planned", "ep_planned_replicas")


def routing(kind: str, tokens: int, experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    """(tokens, top_k) distinct expert ids per token: uniform, or expert e weighted 1 / (e + 1) ** skew."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.ones(experts) if kind == "uniform" else 1.0 / torch.arange(1, experts + 1) ** skew
    return torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=g)


def _block(args, rank: int, group, held):
    from engine.layers.moe import SparseMoeBlock
    from engine.parallel.layers import TPGroup
    cfg = ModelConfig(vocab_size=32, hidden_size=args.hidden, intermediate_size=args.expert_width, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8,
                      moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.expert_width,
                                    renormalize=True))
    block = SparseMoeBlock(cfg, TPGroup(rank, 2, group), held=held)
    g = torch.Generator().manual_seed(0)  # the same full weights on both ranks; each loads its share
    for e in range(args.experts):
        for shard in (0, 1):
            full = torch.randn(args.expert_width, args.hidden, generator=g) / args.hidden ** 0.5
            block.experts.weight_loader(block.experts.w13_weight, full, e, shard)
        down = torch.randn(args.hidden, args.expert_width, generator=g) / args.expert_width ** 0.5
        block.experts.weight_loader(block.experts.w2_weight, down, e)
    from engine.layers.moe import select_expert_methods
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    select_expert_methods(holder, args.method)
    return block


def _rank(rank: int, port: int, args, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(2))
    results = {}
    for kind in ("uniform", "skewed"):
        ids = routing(kind, args.tokens, args.experts, args.top_k, args.skew, seed=3)
        weights = torch.full(ids.shape, 1.0 / args.top_k)
        counts = torch.bincount(ids.flatten(), minlength=args.experts).tolist()
        placements = {"ep": ExpertPlacement.contiguous(args.experts, 2, [0]), "ep_planned": plan({0: counts}, 2),
                      "ep_planned_replicas": plan({0: counts}, 2, args.replicas)}
        for layout in LAYOUTS:
            placement = placements.get(layout)
            block = _block(args, rank, dist.group.WORLD, None if placement is None else placement.held(0, rank))
            compute, calls = [], []
            for _ in range(args.reps + 1):
                dist.barrier()
                start = time.perf_counter()
                partial = block.experts(x, weights, ids)
                mid = time.perf_counter()
                block.tp.all_reduce(partial)
                end = time.perf_counter()
                compute.append((mid - start) * 1e3)
                calls.append((end - start) * 1e3)
            mine = (statistics.median(compute[1:]), statistics.median(calls[1:]))
            both = [None, None]
            dist.all_gather_object(both, mine)
            loads = rank_loads(counts, placement.layers[0]) if placement is not None else [1.0, 1.0]
            results.setdefault(kind, {})[layout] = {
                "ms_per_call": max(c for _, c in both), "rank_compute_ms": [c for c, _ in both],
                "method": block.experts.choice.method(args.tokens),
                "imbalance_counted": imbalance(loads), "imbalance_timed": imbalance([c for c, _ in both]),
                **({"placement": [list(r) for r in placement.layers[0]]} if layout.startswith("ep_planned") else {})}
        results[kind]["tokens_per_expert"] = counts
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_parallel", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=384)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--tokens", type=int, default=32, help="tokens per call (a decode batch)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--skew", type=float, default=1.2)
    p.add_argument("--method", default="auto", help="expert method (engine/layers/expert_compute.py METHOD_CHOICES)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    result = {"shape": {k: getattr(args, k) for k in ("experts", "top_k", "expert_width", "hidden", "tokens",
                                                       "replicas", "skew", "method")}, "routings": results}
    if args.json:
        print(json.dumps(result))
        return 0
    for kind, rows in results.items():
        print(f"{kind} routing, tokens per expert {rows['tokens_per_expert']}")
        for layout in LAYOUTS:
            r = rows[layout]
            print(f"  {layout:<20} {r['method']:<10} {r['ms_per_call']:7.2f} ms/call  "
                  f"ranks {r['rank_compute_ms'][0]:6.2f} {r['rank_compute_ms'][1]:6.2f} ms  imbalance counted {r['imbalance_counted']:.2f} "
                  f"timed {r['imbalance_timed']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
