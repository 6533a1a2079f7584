"""Decode step time per batch size: the colocated engine stepping N running requests.

    python -m bench.decode_steps                        # SmolLM2, the engine's defaults, batches 1, 8, 32
    python -m bench.decode_steps --batches 1 --steps 100 --attention-backend torch
    python -m bench.decode_steps --json
    python -m bench.decode_steps --batch-invariant      # what the batch-invariant mode costs

For each batch size, N requests of `--prompt-len` random tokens are added, prefilled and stepped
3 times unmeasured, then `--steps` decode steps are timed (ms per step, wall clock), and the
requests are aborted. The machine drifts between runs: compare configurations by alternating
runs (e.g. one checkout against another with PYTHONPATH), never against an older table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.offline import random_prompts
from decode_worker.llm import LLM
from engine.attention import BACKENDS
from engine.core.config import QUANTIZATION_CHOICES
from engine.core.request import SamplingParams


def step_times(llm: LLM, batches: list[int], steps: int, prompt_len: int) -> dict[int, float]:
    engine, times = llm.engine, {}
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for n in batches:
        ids = [f"b{n}-{i}" for i in range(n)]
        for rid, prompt in zip(ids, random_prompts(n, prompt_len, seed=n)):
            engine.add_request(rid, prompt, params)
        for _ in range(3):  # prefill, then two warm decode steps
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times[n] = (time.perf_counter() - start) / steps * 1e3
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_steps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES)
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode (engine/quant/batch_invariant.py)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or any(b < 1 for b in batches):
        p.error("--steps and every batch size must be >= 1")
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, quantization=args.quantization,
              attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(batches),
              batch_invariant=args.batch_invariant)
    times = step_times(llm, batches, args.steps, args.prompt_len)
    runner = llm.engine.runner
    config = {"dtype": str(runner.dtype).removeprefix("torch."), "attention": runner.backend.name,
              "kv_cache": str(runner.kv_dtype).removeprefix("torch."),
              "fused_ops": sorted(runner.model.fused), "linear_layers": runner.linear_layers}
    if args.json:
        print(json.dumps({"ms_per_step": times, "config": config, "threads": args.threads}))
    else:
        print(f"{args.model}, {config['dtype']}, attention {config['attention']}, {args.threads} threads")
        for n, ms in times.items():
            print(f"  batch {n:>3}: {ms:7.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
