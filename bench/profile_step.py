"""Where an engine step's time goes: torch.profiler over W1-shaped steps of the colocated engine.

    python -m bench.profile_step                     # SmolLM2, dtype auto, 2 threads
    python -m bench.profile_step --dtype bfloat16 --top 12

Profiles (1) the prefill steps of 32 x 128-token prompts and (2) 10 decode steps at batch 32,
and prints the top operators by self CPU time for each, with their share of the phase.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.offline import random_prompts
from decode_worker.engine import ColocatedEngine
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import SamplingParams


def _table(prof, top: int, wall_s: float) -> str:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    lines = [f"    {'operator':<40}{'calls':>7}{'self ms':>10}{'share':>8}"]
    for e in events[:top]:
        lines.append(f"    {e.key[:40]:<40}{e.count:>7}{e.self_cpu_time_total / 1e3:>10.1f}"
                     f"{e.self_cpu_time_total / total:>8.1%}")
    lines.append(f"    wall {wall_s * 1e3:.0f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model="smollm2", dtype=args.dtype, device="cpu", num_threads=args.threads,
                       cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    engine = ColocatedEngine(cfg)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(32, 128, seed=0)):
        engine.add_request(f"r{i}", prompt, params)
    print(f"SmolLM2, {engine.runner.dtype}, {args.threads} threads, W1 shapes")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        wall = time.perf_counter() - start
    print("prefill (32 x 128 tokens):\n" + _table(prof, args.top, wall))
    engine.step()  # warm the decode path
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(10):
            engine.step()
        wall = time.perf_counter() - start
    print("decode (10 steps at batch 32):\n" + _table(prof, args.top, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
