"""The torch backend's two decode-attention layouts, one layer, interleaved in one run:

    gqa      q (batch, heads, 1, head_dim) against K/V (batch, kv_heads, ctx, head_dim), SDPA's `enable_gqa`
    grouped  q viewed (batch, kv_heads, group, head_dim): each KV head's query heads as one query's rows

    python -m bench.decode_layouts                       # SmolLM2's 9 on 3 heads of 64, fp32, the CPU
    python -m bench.decode_layouts --device cuda --dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128

`TorchAttentionBackend.decode_sdpa` takes `grouped` on the device types in its
GROUPED_DECODE_DEVICES (a GPU; and with soft-capping anywhere): this measures that choice. On a
CPU both run in float32 (the backend's CPU rule); on a GPU in `--dtype`. Prints one JSON object:
median microseconds per call of each layout at each (batch, context), and grouped / gqa.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.attention.torch_backend import TorchAttentionBackend


def _time_us(fn, device: torch.device, calls: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def measure(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
            shapes: list[tuple[int, int]], rounds: int, calls: int) -> dict:
    out = {}
    layouts = {"gqa": (), "grouped": (device.type,)}
    for batch, ctx in shapes:
        gen = torch.Generator().manual_seed(batch * 7 + ctx)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(batch, ctx, kv_heads * head_dim, generator=gen).to(device, dtype) for _ in range(2))
        bias = torch.zeros(batch, 1, ctx, device=device)
        times = {name: [] for name in layouts}
        for r in range(rounds):  # alternated, so that drift falls on both
            for name in (list(layouts) if r % 2 else list(reversed(layouts))):
                TorchAttentionBackend.GROUPED_DECODE_DEVICES = layouts[name]
                times[name].append(_time_us(lambda: TorchAttentionBackend.decode_sdpa(
                    q, k, v, kv_heads, head_dim ** -0.5, bias), device, calls))
        med = {name: statistics.median(t) for name, t in times.items()}
        out[f"{batch}x{ctx}"] = {"gqa_us": round(med["gqa"], 1), "grouped_us": round(med["grouped"], 1),
                                 "grouped_over_gqa": round(med["grouped"] / med["gqa"], 3)}
    TorchAttentionBackend.GROUPED_DECODE_DEVICES = ("cuda",)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_layouts", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--shapes", nargs="+", default=["1x256", "8x256", "32x256", "8x1024"], help="BATCHxCONTEXT")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    result = measure(device, getattr(torch, args.dtype), args.heads, args.kv_heads, args.head_dim, shapes,
                     args.rounds, args.calls)
    print(json.dumps({"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "heads": [args.heads, args.kv_heads, args.head_dim], "layouts": result}))


if __name__ == "__main__":
    main()
