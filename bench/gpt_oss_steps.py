"""What gpt-oss's extras cost: decode steps of a gpt-oss-shaped mixture against a Qwen3-MoE of the
same shape, on each CPU attention backend, in one run.

    python -m bench.gpt_oss_steps                       # batches 1, 8, 32 on torch, vllm_cpu, flex
    python -m bench.gpt_oss_steps --backends torch --json

Both are tiny random checkpoints from transformers' config classes, with the same hidden size,
heads, experts, top-k and expert width. gpt-oss adds attention sinks, q/k/v/o biases, alternating
sliding (--window) and full layers, a router bias, expert biases and the clamped SwiGLU over
interleaved rows (engine/models/gpt_oss.py); Qwen3-MoE adds q/k norms. The expert method is auto
for both. With the default window (128, gpt-oss's) and prompts (64 tokens) no window binds, so
the ratio is the price of the extras at equal attention work. Wall-clock means over the timed
steps (bench/decode_steps.py); compare within one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.decode_steps import step_times
from bench.moe_steps import add_step_args, engine_for, step_setup

BACKENDS = ("torch", "vllm_cpu", "flex")


def build(folder: Path, shape: dict, experts: int, top_k: int, width: int, window: int) -> dict[str, Path]:
    """The two checkpoints: "gpt_oss" and "qwen3_moe", alike but for gpt-oss's extras."""
    import transformers
    torch.manual_seed(0)
    moe = dict(num_experts_per_tok=top_k)
    models = {
        "gpt_oss": transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **shape, intermediate_size=width, num_local_experts=experts, sliding_window=window, **moe)),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, intermediate_size=width, num_experts=experts, moe_intermediate_size=width,
            norm_topk_prob=True, **moe)),
    }
    for name, model in models.items():
        model.save_pretrained(folder / name, safe_serialization=True)
    return {name: folder / name for name in models}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpt_oss_steps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    add_step_args(p)
    p.add_argument("--window", type=int, default=128, help="gpt-oss's sliding window (its published one)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    args = p.parse_args(argv)
    shape, batches = step_setup(args)
    result: dict = {"shape": {**shape, "experts": args.experts, "top_k": args.top_k, "expert_width": args.expert_width,
                              "window": args.window}, "threads": args.threads, "decode_ms_per_step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp), shape, args.experts, args.top_k, args.expert_width, args.window)
        for backend in args.backends.split(","):
            steps = {}
            for _round in range(2):  # alternate the two models; the second round's times count
                for name, folder in folders.items():
                    llm = engine_for(folder, args.threads, max(batches), attention_backend=backend)
                    steps[name] = step_times(llm, batches, args.steps, args.prompt_len)
                    result["dtype"] = str(llm.engine.runner.dtype).removeprefix("torch.")
                    del llm
            result["decode_ms_per_step"][backend] = {
                n: {"gpt_oss": steps["gpt_oss"][n], "qwen3_moe": steps["qwen3_moe"][n],
                    "gpt_oss_over_qwen3_moe": steps["gpt_oss"][n] / steps["qwen3_moe"][n]} for n in batches}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.experts} experts, top {args.top_k}, width {args.expert_width}, window {args.window}; "
          f"{result['dtype']}, {args.threads} threads")
    for backend, rows in result["decode_ms_per_step"].items():
        for n, row in rows.items():
            print(f"  {backend:>8} batch {n:>3}: gpt-oss {row['gpt_oss']:7.2f} ms  qwen3-moe {row['qwen3_moe']:7.2f} ms"
                  f"  ratio {row['gpt_oss_over_qwen3_moe']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
