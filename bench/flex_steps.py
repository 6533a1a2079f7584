"""Attention time per step, the flex backend against the torch backend, on random paged caches.

    python -m bench.flex_steps                         # SmolLM2's heads (9 on 3, head_dim 64), fp32, 2 threads
    python -m bench.flex_steps --dtype bfloat16 --reps 10

For each step shape (decodes over their contexts, a prefill, a chunk over cached context, decodes
and a chunk mixed), both backends run `prepare` and then `--layers` layers' `forward` (each writes
the new K/V and attends), alternately, `--reps` times; the least (and the median) of each is
printed as JSON, in ms per step's attention, with flex's first step apart (its compile, or a load of inductor's on-disk
cache: `compile_s`) and the padded shape it ran. Attention only: a model's step adds its linear
layers, the same on both backends. The machine drifts: the two backends alternate within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch._inductor.config

from engine.attention import AttentionMetadata
from engine.attention.flex_backend import MIN_KEYS, MIN_QUERIES, FlexAttentionBackend, padded
from engine.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16
# name -> [(cached tokens, new tokens)] per sequence, decodes first
STEPS = {
    "decode_1x256": [(255, 1)],
    "decode_8x256": [(255, 1)] * 8,
    "decode_32x256": [(255, 1)] * 32,
    "decode_8x1024": [(1023, 1)] * 8,
    "prefill_512": [(0, 512)],
    "chunk_256_over_1024": [(1024, 256)],
    "mixed_8x256_and_chunk_128": [(255, 1)] * 8 + [(256, 128)],
}


def build_step(seqs, heads: int, kv_heads: int, head_dim: int, dtype, gen):
    """Metadata as the runner builds it (blocks drawn at random from the pool), q/k/v and a cache."""
    need = [-(-(c + n) // BLOCK_SIZE) for c, n in seqs]
    num_blocks = 1 + sum(need)
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots = [], []
    for (c, n), nb in zip(seqs, need):
        blocks, pool = pool[:nb], pool[nb:]
        tables.append(blocks + [0] * (max(need) - nb))
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
    query_lens, seq_lens = [n for _, n in seqs], [c + n for c, n in seqs]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(num_decodes=sum(n == 1 for n in query_lens), query_lens=query_lens,
                             seq_lens_cpu=seq_lens, query_start_loc=torch.tensor(cu, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32),
                             slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=BLOCK_SIZE)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    return meta, q, k, v, cache


def step_ms(backend, step, layers: int) -> float:
    meta, q, k, v, cache = step
    scale = q.shape[-1] ** -0.5
    start = time.perf_counter()
    backend.prepare(meta)
    for _ in range(layers):
        backend.forward(q, k, v, cache, meta, scale)
    return (time.perf_counter() - start) * 1e3


def measure(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    step = build_step(STEPS[name], args.heads, args.kv_heads, args.head_dim, dtype, torch.Generator().manual_seed(0))
    flex, ref = FlexAttentionBackend(torch.device("cpu")), TorchAttentionBackend()
    start = time.perf_counter()
    step_ms(flex, step, 1)
    compile_s = time.perf_counter() - start
    step_ms(ref, step, 1)
    times = {"flex": [], "torch": []}
    for _ in range(args.reps):
        for label, backend in (("flex", flex), ("torch", ref)):
            times[label].append(step_ms(backend, step, args.layers))
    meta = step[0]
    keys = sum(meta.seq_lens_cpu)
    row = {"step": name, "tokens": sum(meta.query_lens), "keys": keys,
           "padded": [padded(sum(meta.query_lens), MIN_QUERIES), padded(keys, MIN_KEYS)],
           "compile_s": round(compile_s, 2)}
    for label, values in times.items():  # the least: other processes on the cores only ever add time
        row[f"{label}_ms"] = round(min(values), 2)
        row[f"{label}_median_ms"] = round(statistics.median(values), 2)
    row["flex_over_torch"] = round(row["flex_ms"] / row["torch_ms"], 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flex_steps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers per step (SmolLM2: 30)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    args = p.parse_args(argv)
    names = args.steps.split(",")
    if unknown := [n for n in names if n not in STEPS]:
        p.error(f"unknown steps {unknown}")
    torch.set_num_threads(args.threads)
    # compile in this process: inductor's pool of compile workers, started on the first compile,
    # takes the cores for seconds afterwards and would be timed as flex's (2.0 -> 50 ms a layer seen)
    rows = []
    with torch.inference_mode(), torch._inductor.config.patch(compile_threads=1):
        for name in names:
            rows.append(measure(name, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    config = {k: getattr(args, k) for k in ("dtype", "heads", "kv_heads", "head_dim", "layers", "reps", "threads")}
    print(json.dumps({"config": config, "torch": torch.__version__, "steps": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
