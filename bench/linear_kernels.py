"""Linear kernels on SmolLM2's shapes: unquantized fp32 / bf16 against each int8 and int4 candidate.

    python -m bench.linear_kernels                       # M = 1, 8, 32, 128, 512; 2 threads
    python -m bench.linear_kernels --m 1,64 --json

Times are ms per call, the least of `--rounds` samples interleaved across kernels (other processes
only ever add time), each sample about 0.2 ms of back-to-back calls; the same timing the
engine uses when it picks a kernel at load (engine/quant/selection.py), weights cold (rotating
through copies that cover 1.5x the last-level cache). The `layer` rows sum one decoder layer's
four linears (qkv, o, gate_up, down).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import torch
import torch.nn.functional as F

from engine.core.config import cpu_has_native_bf16
from engine.loading.loader import load_model_config, resolve_model_path
from engine.quant.base import (FbgemmKernel, LinearKernel, Int8PackKernel, ReferenceKernel, UnquantizedBaseline,
                                  dequantize)
from engine.quant.integer import DequantizedKernel, Int4PackKernel
from engine.quant.q4 import random_q4
from engine.quant.selection import measuring_time_fn, processor_name

logger = logging.getLogger("bench.linear_kernels")


class FLinear(LinearKernel):
    """Plain F.linear on the dequantized weight (bf16 F.linear reorders the weight every call)."""

    name, label = "flinear", "F.linear"

    def prepare(self, qweight, scale, dtype):
        return dequantize(qweight, scale, dtype)

    def run(self, state, x):
        return F.linear(x, state)


def smollm2_shapes() -> dict[str, tuple[int, int]]:
    c = load_model_config(resolve_model_path("smollm2"))
    return {"qkv_proj": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size)}


def columns() -> list[tuple[str, str, torch.dtype]]:
    """(column, kernel name, activation dtype); each kernel object is built in `bench`."""
    cols = [("fp32 F.linear", "flinear", torch.float32), ("bf16 F.linear", "flinear", torch.bfloat16)]
    cols.append(("fp32 oneDNN packed", "unquantized", torch.float32))
    if cpu_has_native_bf16():
        cols.append(("bf16 oneDNN packed", "unquantized", torch.bfloat16))
    cols += [("int8 fbgemm", "fbgemm", torch.float32), ("int8 int8pack fp32", "int8pack", torch.float32),
             ("int8 int8pack bf16", "int8pack", torch.bfloat16), ("int8 reference fp32", "reference", torch.float32),
             ("int4 int4pack fp32", "int4pack", torch.float32), ("int4 int4pack bf16", "int4pack", torch.bfloat16)]
    return cols


INT4 = ("int4pack", "dequantized")  # kernels timed on Q4 weights (random_q4), the rest on int8 ones


def bench(ms: list[int], rounds: int) -> dict:
    """{column: {shape name or "layer": {M: ms}}}; a kernel over 60x the fastest column at a
    smaller M is not run at larger ones (recorded as None)."""
    shapes, device = smollm2_shapes(), torch.device("cpu")
    kernels = {"flinear": FLinear(), "unquantized": UnquantizedBaseline(), "fbgemm": FbgemmKernel(),
               "int8pack": Int8PackKernel(), "reference": ReferenceKernel()}
    int4 = [Int4PackKernel(), DequantizedKernel()]
    time_fns = {(q, d): measuring_time_fn(int4, d, device, random_q4) if q else
                measuring_time_fn(list(kernels.values()), d, device)
                for q in (False, True) for d in (torch.float32, torch.bfloat16)}
    table = {col: {s: {} for s in [*shapes, "layer"]} for col, _, _ in columns()}
    skipped: set[str] = set()
    for m in ms:
        best = {}
        for _ in range(rounds):
            for col, name, dtype in columns():
                if col in skipped:
                    continue
                for shape_name, shape in shapes.items():
                    sample = time_fns[name in INT4, dtype](name, shape, m)
                    best[col, shape_name] = min(best.get((col, shape_name), math.inf), sample)
        for col, _, _ in columns():
            if col in skipped:
                continue
            for shape_name in shapes:
                table[col][shape_name][m] = best[col, shape_name]
            table[col]["layer"][m] = sum(best[col, s] for s in shapes)
        fastest = min(table[c]["layer"][m] for c, _, _ in columns() if c not in skipped)
        skipped |= {c for c, _, _ in columns() if c not in skipped and table[c]["layer"][m] > 60 * fastest}
    return {"shapes": shapes, "ms": table, "processor": processor_name(device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "fbgemm_reduce_range": FbgemmKernel().reduce_range}


def format_table(result: dict, ms: list[int]) -> str:
    lines = [f"{result['processor']}, {result['threads']} threads, torch {result['torch']}; ms per call "
             f"(fbgemm reduce_range={result['fbgemm_reduce_range']})"]
    for shape_name in [*result["shapes"], "layer"]:
        shape = result["shapes"].get(shape_name, "sum of the four")
        lines += ["", f"{shape_name} {shape}", f"{'kernel':<22}" + "".join(f"{'M=' + str(m):>10}" for m in ms)]
        for col, rows in result["ms"].items():
            cells = [rows[shape_name].get(m) for m in ms]
            lines.append(f"{col:<22}" + "".join(f"{'-' if c is None else f'{c:.3f}':>10}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.linear_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,8,32,128,512", help="numbers of tokens, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7, help="interleaved samples per kernel, shape and M")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.m.split(",")]
    result = bench(ms, args.rounds)
    print(json.dumps(result) if args.json else format_table(result, ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
