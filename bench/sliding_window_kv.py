"""KV a sliding window saves: bytes a 1P1D transfer ships and KV the decode instance holds per
request, for one long prompt, with the window and with full attention (same model otherwise):
a Mistral (every layer slides) and a Gemma 2 (sliding and global layers alternate, each kind a
KV group with its own block tables).

    python -m bench.sliding_window_kv                      # 4,096-token prompt, 512-token window
    python -m bench.sliding_window_kv --prompt-len 8192 --window 1024 --json

The models are small and random (transformers' MistralConfig and Gemma2Config, 4 layers, saved
as safetensors: no download), run for real through an in-process 1P1D cluster: the bytes are the
decode receiver's count, the KV held the most the decode allocator held for the request while it
generated (its blocks, sampled every millisecond, times a block's bytes). Layer-tokens (one
layer's K and V of one token) do not depend on the model's size; bytes are also given in the KV
shape of Mistral 7B (8 KV heads x 128, bf16: 4 KiB a layer-token) and Gemma 2 9B (8 x 256: 8 KiB),
scaled from the measured layer-tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# (layers, bytes of a layer-token) of Mistral 7B and Gemma 2 9B (alternating like the small one)
REAL_SHAPE = {"mistral": (32, 2 * 8 * 128 * 2), "gemma2": (42, 2 * 8 * 256 * 2)}
NUM_LAYERS = 4
RUNS = (("mistral", True), ("mistral", False), ("gemma2", True), ("gemma2", False))


def save_model(folder: Path, family: str, window: int, sliding: bool, max_len: int) -> str:
    """A 4-layer random model; `sliding` False: every layer global (same weights' shapes)."""
    import torch
    import transformers
    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_len)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape,
                                                                           sliding_window=window if sliding else None))
    else:
        types = (["sliding_attention", "full_attention"] * (NUM_LAYERS // 2) if sliding
                 else ["full_attention"] * NUM_LAYERS)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape, sliding_window=window,
                                                                         layer_types=types))
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def measure(model: str, prompt_len: int, max_tokens: int, block_size: int) -> dict:
    import torch

    from cluster.control.cluster import Cluster
    from cluster.spec import ClusterSpec
    from engine.core.kv_cache import kv_block_bytes
    from engine.core.request import SamplingParams
    from engine.loading.loader import hf_model_config
    groups = hf_model_config(Path(model)).kv_layout.num_groups
    spec = ClusterSpec(model=model, dtype="float32", device="cpu", block_size=block_size,
                       num_kv_blocks=groups * (-(-(prompt_len + max_tokens) // block_size) + 8), max_num_seqs=4,
                       max_num_batched_tokens=1024, num_threads=1)
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with Cluster(spec, use_ray=False) as cluster:
        decode = cluster.instances["decode-0"].ranks[0]
        scheduler = decode.worker.engine.scheduler
        kv, peak, schedule = decode.worker.engine.kv, [0], scheduler.schedule

        def schedule_and_count():
            """Blocks are taken when a step is scheduled (and freed after it): the count right after
            each schedule is the exact peak, which a sampling thread could miss on a busy host."""
            out = schedule()
            for tables in kv.req_to_blocks.values():
                peak[0] = max(peak[0], sum(b.block_id != 0 for blocks in tables for b in blocks))
            return out

        scheduler.schedule = schedule_and_count
        streams = cluster.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                   timeout_s=600)
        assert streams[0].error is None, streams[0].error
        mc, bs = decode.runner.model_config, decode.runner.block_size
        layer_token = 2 * mc.num_kv_heads * mc.head_dim * 4  # fp32
        block_bytes = kv_block_bytes(mc, mc.num_kv_heads, bs, torch.float32)
        got = decode.receiver.stats["bytes_received"]
        return {"kv_layout": mc.kv_layout.signature, "bytes_transferred": got,
                "layer_tokens_transferred": got // layer_token, "tokens_transferred": got / layer_token / mc.num_layers,
                "decode_blocks_held_peak": peak[0], "block_size": bs,
                "decode_layer_tokens_held_peak": peak[0] * block_bytes // layer_token,
                "decode_kv_bytes_held_peak": peak[0] * block_bytes, "blocks_freed_while_decoding": kv.num_window_freed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--family", choices=("mistral", "gemma2", "both"), default="both")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    max_len = args.prompt_len + args.max_tokens + 64
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, sliding in RUNS:
            if args.family in (family, "both"):
                name = f"{family}_{'window' if sliding else 'full'}"
                folder = save_model(Path(tmp) / name, family, args.window, sliding, max_len)
                r = results[name] = measure(folder, args.prompt_len, args.max_tokens, args.block_size)
                layers, layer_token = REAL_SHAPE[family]
                r["real_model_bytes_transferred"] = r["layer_tokens_transferred"] * layers // NUM_LAYERS * layer_token
                r["real_model_kv_bytes_held_peak"] = (r["decode_layer_tokens_held_peak"] * layers // NUM_LAYERS
                                                      * layer_token)
    results["config"] = vars(args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, r in results.items():
            if name != "config":
                print(f"{name:15s} {r['kv_layout']:>16s}: {r['layer_tokens_transferred']} layer-tokens shipped "
                      f"({r['bytes_transferred']} B), decode peak {r['decode_blocks_held_peak']} blocks of "
                      f"{r['block_size']} ({r['decode_layer_tokens_held_peak']} layer-tokens), "
                      f"{r['blocks_freed_while_decoding']} blocks freed while decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
