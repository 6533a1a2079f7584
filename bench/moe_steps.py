"""A small mixture of experts against a dense model of the same active parameters, in one run.

    python -m bench.moe_steps                    # decode steps at batches 1, 8, 32, and the expert paths
    python -m bench.moe_steps --json --steps 10

1. Decode step time (the colocated engine, bench/decode_steps.py) of a Qwen3-MoE of `--experts`
   experts, `--top-k` per token, each `--expert-width` wide, against a dense Qwen3 whose MLP is
   top_k * expert_width wide: the same attention, the same FLOPs per token. Both are tiny random
   checkpoints built from transformers' config classes, in the engine's dtype.
2. The expert paths on one sparse layer's weights: each method (engine/layers/expert_compute.py) at
   1, 8, 32 and 256 tokens of random routing, against one dense SwiGLU of the same FLOPs (the
   dense model's MLP), and which method `--expert-method auto` runs at each batch; and the int8
   and int4 experts of `--quantization int8` / `int4` (their kernel timed at load, as the runner
   does). The decode steps of 1. run with auto, and the mixture's again with each `--quantized`
   method (every linear and expert quantized, as a user gets it).

Wall-clock medians; compare within one run (machines drift between runs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.decode_steps import step_times
from decode_worker.engine import ColocatedEngine
from decode_worker.llm import LLM
from engine.core.choices import MethodChoice
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.layers.expert_compute import (METHODS, PACKED, sort_pairs, vllm_cpu_experts,
                                          vllm_cpu_moe_unavailable, vllm_cpu_pack)
from engine.layers.common import silu_and_mul
from engine.layers.moe import moe_blocks
from engine.layers.quant_experts import FORMATS, quantize_experts, quantized_experts
from engine.runner.model_runner import ModelRunner

SHAPE = dict(vocab_size=40960, hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
TINY = {**SHAPE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}  # --tiny: a smoke run (tests/bench/test_moe_bench.py); the vocabulary fits the prompts


def build(folder: Path, shape: dict, experts: int, top_k: int, width: int) -> dict[str, Path]:
    """The two checkpoints: "moe" (Qwen3-MoE) and "dense" (Qwen3, MLP width top_k * width)."""
    import transformers
    torch.manual_seed(0)
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **shape, intermediate_size=top_k * width, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, norm_topk_prob=True))
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, intermediate_size=top_k * width))
    out = {}
    for name, model in (("moe", moe), ("dense", dense)):
        model.save_pretrained(folder / name, safe_serialization=True)
        out[name] = folder / name
    return out


def engine_for(folder: Path, threads: int, max_seqs: int, expert_method: str = "auto",
               attention_backend: str = "auto", quantization: str = "auto") -> LLM:
    config = EngineConfig(model=str(folder), num_threads=threads, device="cpu", expert_method=expert_method,
                          attention_backend=attention_backend, quantization=quantization,
                          cache=CacheConfig(num_blocks=max_seqs * 16 + 8, block_size=16),
                          scheduler=SchedulerConfig(max_num_seqs=max_seqs))
    return LLM(engine=ColocatedEngine(config, runner=ModelRunner(config)))  # no tokenizer: token ids in


def median_ms(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def expert_paths(llm: LLM, auto: MethodChoice, token_counts: list[int], reps: int) -> tuple[dict, dict]:
    """Each expert method on the first sparse layer (the model loaded with the loop method, so its
    weights are in the loaded layout), against the dense SwiGLU of the same FLOPs; `auto`: what
    --expert-method auto chose for the same layer at load. Also the layer's expert weight bytes,
    float and as each quantized kernel holds them."""
    (_, block), *_ = moe_blocks(llm.engine.runner.model)
    w13, w2, top_k = block.experts.w13_weight, block.experts.w2_weight, block.top_k
    experts, hidden, width = w13.shape[0], w13.shape[2], w2.shape[2]
    g = torch.Generator().manual_seed(1)
    dense13 = (torch.randn(2 * top_k * width, hidden, generator=g) / hidden ** 0.5).to(w13.dtype)
    dense2 = (torch.randn(hidden, top_k * width, generator=g) / width ** 0.5).to(w13.dtype)
    packed = None if vllm_cpu_moe_unavailable(w13, w2, None) else (vllm_cpu_pack(w13), vllm_cpu_pack(w2))
    quantized = {q: quantize_experts(q, w13, w2) for q in FORMATS}  # --quantization int8's / int4's experts
    weight_bytes = {"float": nbytes((w13, w2)), **{q: nbytes(quant.states) for q, quant in quantized.items()}}
    out = {}
    for n in token_counts:
        x = torch.randn(n, hidden, generator=g).to(w13.dtype)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
        weights = torch.full(ids.shape, 1.0 / top_k)
        row = {m: median_ms(lambda m=m: METHODS[m](x, w13, w2, sort_pairs(ids, weights, experts, None)), reps)
               for m in METHODS}
        if packed is not None:
            row[PACKED] = median_ms(lambda: vllm_cpu_experts(x, *packed, weights, ids), reps)
        for q, quant in quantized.items():  # each through the kernel timed fastest at load
            row[q] = median_ms(lambda quant=quant: quantized_experts(x, quant, sort_pairs(ids, weights, experts, None)),
                               reps)
            row[f"{q}_kernel"] = quant.kernel.name
        row["dense_same_flops"] = median_ms(lambda: F.linear(silu_and_mul(F.linear(x, dense13)), dense2), reps)
        row["auto_runs"] = auto.method(n)
        row["experts_touched"] = int(ids.unique().numel())
        out[n] = row
    return out, weight_bytes


def nbytes(obj) -> int:
    """The bytes of every tensor in a kernel's prepared state (tensors, tuples, namespaces)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(map(nbytes, obj))
    return sum(map(nbytes, vars(obj).values())) if hasattr(obj, "__dict__") else 0


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The mixture's shape and the decode steps' knobs (bench.gpt_oss_steps takes them too)."""
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--prompt-len", type=int, default=64,
                   help="keep batch x prompt within one step's token budget (so prefill is done before the "
                        "timed steps) and prompt + steps within the KV pool's 256 tokens a sequence")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden size 64 (a smoke run)")
    p.add_argument("--json", action="store_true")


def step_setup(args: argparse.Namespace) -> tuple[dict, list[int]]:
    """The model shape and batch sizes `add_step_args` parsed; sets torch's threads."""
    torch.set_num_threads(args.threads)
    return TINY if args.tiny else SHAPE, [int(b) for b in args.batches.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_steps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    add_step_args(p)
    p.add_argument("--reps", type=int, default=20, help="timed calls per expert path and token count")
    p.add_argument("--quantized", default="int8,int4", help="the mixture's decode steps again with each of these "
                   "--quantization methods (empty: none)")
    args = p.parse_args(argv)
    shape, batches = step_setup(args)
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp), shape, args.experts, args.top_k, args.expert_width)
        steps, config = {}, {}
        for _round in range(2):  # alternate the two models; the second round's times count
            for name, folder in folders.items():
                llm = engine_for(folder, args.threads, max(batches))
                steps[name] = step_times(llm, batches, args.steps, args.prompt_len)
                config[name] = str(llm.engine.runner.dtype).removeprefix("torch.")
                if name == "moe" and _round == 1:
                    auto = llm.engine.runner.model.layers[0].mlp.experts.choice
                    del llm
                    for q in filter(None, args.quantized.split(",")):
                        llm = engine_for(folder, args.threads, max(batches), quantization=q)
                        steps[f"moe_{q}"] = step_times(llm, batches, args.steps, args.prompt_len)
                        del llm
                    llm = engine_for(folder, args.threads, max(batches), expert_method="loop")
                    paths, weight_bytes = expert_paths(llm, auto, [1, 8, 32, 256], args.reps)
                del llm
    result = {"shape": {**shape, "experts": args.experts, "top_k": args.top_k, "expert_width": args.expert_width,
                        "dense_width": args.top_k * args.expert_width}, "dtype": config, "threads": args.threads,
              "decode_ms_per_step": {n: {**{k: v[n] for k, v in steps.items()},
                                         "moe_over_dense": steps["moe"][n] / steps["dense"][n]} for n in batches},
              "expert_paths_ms": paths, "auto_choice": auto.describe(), "expert_weight_bytes_per_layer": weight_bytes}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.experts} experts, top {args.top_k}, width {args.expert_width}; {config['moe']}, "
          f"{args.threads} threads")
    for n, row in result["decode_ms_per_step"].items():
        quantized = "".join(f"  {k} {v:7.2f} ms" for k, v in row.items()
                            if k.startswith("moe_") and k != "moe_over_dense")
        print(f"  decode batch {n:>3}: moe {row['moe']:7.2f} ms  dense {row['dense']:7.2f} ms  "
              f"moe/dense {row['moe_over_dense']:.2f}{quantized}")
    print("  expert weights per layer: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in weight_bytes.items()))
    for n, row in paths.items():
        times = "  ".join(f"{m} {row[m]:.3f}" + (f" ({row[m + '_kernel']})" if m in FORMATS else "")
                          for m in (*METHODS, PACKED, *FORMATS, "dense_same_flops") if m in row)
        print(f"  layer, {n:>3} tokens ({row['experts_touched']} experts): {times} ms; auto runs {row['auto_runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
