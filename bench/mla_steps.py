"""DeepSeek's latent attention (engine/layers/mla.py) against grouped-query attention of the same hidden size.

    python -m bench.mla_steps                 # KV bytes, decode steps by form, transfer of a 2,048-token prompt
    python -m bench.mla_steps --json

Two tiny random checkpoints from transformers' config classes, every layer dense (no experts, so
attention is what differs): "mla", a DeepSeek-V2 of `--hidden` with `--heads` heads, latent
`--kv-lora-rank` and rope `--rope-dim` wide; "gqa", a Llama of the same hidden size, heads and
MLP, its heads hidden / heads wide on `--kv-heads` KV heads.

1. KV bytes per token per layer: from each model's cache (its pool's bytes over blocks, block size
   and layers) and from the KV transfer's counters (bytes the decode instance received for one
   prompt, over its tokens and layers), an in-process 1P1D cluster.
2. Decode step time of the MLA model, absorbed against expanded (`MLAAttention.decode_form`), at
   each batch and context: the same requests, prefilled once, then the forms' steps alternated.
3. Transfer time of a `--transfer-len`-token prompt's KV, MLA against GQA (the prefill side's
   transfer clock: first byte out to last part acknowledged), median of `--transfers` prompts.

Wall-clock; compare within one run (machines drift between runs).
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

from bench.offline import random_prompts
from decode_worker.engine import ColocatedEngine
from decode_worker.llm import LLM
from engine.core.choices import FORMS
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.kv_cache import kv_block_bytes
from engine.core.request import SamplingParams
from engine.layers.mla import MLAAttention
from engine.runner.model_runner import ModelRunner


def build(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    import transformers
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=8192,
                 tie_word_embeddings=True)
    torch.manual_seed(0)
    mla = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **shape, num_key_value_heads=args.heads, kv_lora_rank=args.kv_lora_rank, q_lora_rank=None,
        qk_nope_head_dim=args.nope_dim, qk_rope_head_dim=args.rope_dim, v_head_dim=args.nope_dim,
        first_k_dense_replace=args.layers, n_routed_experts=8, num_experts_per_tok=2))
    gqa = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, num_key_value_heads=args.kv_heads))
    out = {}
    for name, model in (("mla", mla), ("gqa", gqa)):
        model.save_pretrained(folder / name, safe_serialization=True)
        out[name] = folder / name
    return out


def config(folder: Path, args: argparse.Namespace, max_seqs: int, tokens: int) -> EngineConfig:
    # fp32, as transfers() runs: `auto` is bf16 on a CPU with native bf16, which would halve the
    # cache's bytes per token against the transfer's
    return EngineConfig(model=str(folder), dtype="float32", num_threads=args.threads, device="cpu",
                        cache=CacheConfig(num_blocks=tokens // 16 + 8, block_size=16),
                        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096))


def cache_bytes_per_token(runner: ModelRunner) -> float:
    mc = runner.model_config
    block = kv_block_bytes(mc, runner.num_kv_heads, runner.block_size, runner.kv_dtype)
    return block / runner.block_size / mc.kv_layout.num_slabs


def decode_forms(folder: Path, args: argparse.Namespace, batches: list[int], contexts: list[int]) -> dict:
    """{context: {batch: {form: ms per step}}} of the MLA model."""
    out: dict = {}
    for context in contexts:
        cfg = config(folder, args, max(batches), max(batches) * (context + 4 * args.steps + 16))
        llm = LLM(engine=ColocatedEngine(cfg, runner=ModelRunner(cfg)))
        engine, layers = llm.engine, [layer.self_attn for layer in llm.engine.runner.model.layers]
        assert all(isinstance(a, MLAAttention) for a in layers)
        out[context] = {}
        for n in batches:
            ids = [f"c{context}-b{n}-{i}" for i in range(n)]
            params = SamplingParams(max_tokens=4 * args.steps + 8, temperature=0.0, ignore_eos=True)
            for rid, prompt in zip(ids, random_prompts(n, context, seed=n)):
                engine.add_request(rid, prompt, params)
            while engine.scheduler.waiting or any(r.num_computed_tokens < context for r in engine.scheduler.running):
                engine.step()
            times: dict[str, list[float]] = {form: [] for form in FORMS}
            for _round in range(2):
                for form in FORMS:
                    for a in layers:
                        a.decode_form = form
                    engine.step()  # warm
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        engine.step()
                    times[form].append((time.perf_counter() - start) / args.steps * 1e3)
            out[context][n] = {form: ms[-1] for form, ms in times.items()}
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished():
                engine.step()
        del llm
    return out


def transfers(folder: Path, args: argparse.Namespace) -> dict:
    """One in-process 1P1D: each prompt's KV bytes (decode side) and transfer time (prefill side)."""
    from cluster.control.cluster import Cluster
    from cluster.spec import ClusterSpec
    tokens = args.transfer_len + 64
    spec = ClusterSpec(model=str(folder), dtype="float32", device="cpu", mode="disaggregated", num_prefill=1,
                       num_decode=1, num_kv_blocks=tokens // 16 + 8, max_num_seqs=4, max_num_batched_tokens=4096,
                       num_threads=args.threads, kv_transfer_timeout_s=120.0)
    cluster = Cluster(spec, use_ray=False).start()
    try:
        prefill = next(i for i in cluster.instances.values() if i.role == "prefill")
        decode = next(i for i in cluster.instances.values() if i.role != "prefill")
        seconds, received = [], []
        for seed in range(args.transfers):
            before = prefill.client.load()["kv_transfer_seconds"], decode.client.load()["kv_bytes_received"]
            prompt = random_prompts(1, args.transfer_len, seed=100 + seed)[0]
            streams = cluster.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                       timeout_s=600)
            assert all(s.error is None for s in streams), [s.error for s in streams]
            seconds.append(prefill.client.load()["kv_transfer_seconds"] - before[0])
            received.append(decode.client.load()["kv_bytes_received"] - before[1])
        return {"transfer_ms": statistics.median(seconds) * 1e3, "bytes_received": statistics.median(received)}
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mla_steps", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="the GQA model's")
    p.add_argument("--kv-lora-rank", type=int, default=256)
    p.add_argument("--nope-dim", type=int, default=64, help="qk_nope_head_dim and v_head_dim")
    p.add_argument("--rope-dim", type=int, default=32)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=40960, help="above bench.offline's prompt token ids")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="256,2048")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per form, batch and context")
    p.add_argument("--transfer-len", type=int, default=2048)
    p.add_argument("--transfers", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp), args)
        result = {"shape": {k: v for k, v in vars(args).items() if k not in ("json",)}, "kv_bytes_per_token_layer": {},
                  "transfer": {}}
        for name, folder in folders.items():
            runner = ModelRunner(config(folder, args, 1, 64))
            layers = runner.model_config.num_layers
            result["kv_bytes_per_token_layer"][name] = {"cache": cache_bytes_per_token(runner)}
            del runner
            moved = transfers(folder, args)
            result["transfer"][name] = moved
            result["kv_bytes_per_token_layer"][name]["transfer"] = moved["bytes_received"] / args.transfer_len / layers
        result["decode_ms_per_step"] = decode_forms(folders["mla"], args, batches, contexts)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, b in result["kv_bytes_per_token_layer"].items():
        print(f"{name}: KV bytes per token per layer: cache {b['cache']:.0f}, transfer {b['transfer']:.0f}; "
              f"{args.transfer_len}-token prompt's transfer {result['transfer'][name]['transfer_ms']:.1f} ms")
    for context, rows in result["decode_ms_per_step"].items():
        for n, ms in rows.items():
            print(f"  context {context:>5}, batch {n:>3}: " + "  ".join(f"{f} {v:7.2f} ms" for f, v in ms.items())
                  + f"  expanded/absorbed {ms['expanded'] / ms['absorbed']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
