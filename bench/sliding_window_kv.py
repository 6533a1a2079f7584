"""KV a sliding window saves: bytes a 1P1D transfer ships and blocks the decode instance holds
per request, for one long prompt, with the window and with full attention (same model otherwise).

    python -m bench.sliding_window_kv                      # 4,096-token prompt, 512-token window
    python -m bench.sliding_window_kv --prompt-len 8192 --window 1024 --json

The model is a small random Mistral (transformers' MistralConfig, saved as safetensors: no
download), run for real through an in-process 1P1D cluster: the bytes are the decode receiver's
count, the blocks the most the decode allocator held for the request while it generated
(sampled every millisecond). Tokens and blocks do not depend on the model's size; bytes are also
given per token of Mistral 7B's KV shape (32 layers x 8 KV heads x 128 x bf16 = 128 KiB), scaled
from the measured token count.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

MISTRAL_7B_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def save_model(folder: Path, window: int | None, max_len: int) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_len,
                        sliding_window=window)
    MistralForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def measure(model: str, prompt_len: int, max_tokens: int, block_size: int) -> dict:
    import torch

    from cluster.cluster import Cluster
    from cluster.spec import ClusterSpec
    from engine.request import SamplingParams
    spec = ClusterSpec(model=model, dtype="float32", device="cpu", block_size=block_size,
                       num_kv_blocks=-(-(prompt_len + max_tokens) // block_size) + 8, max_num_seqs=4,
                       max_num_batched_tokens=1024, num_threads=1)
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with Cluster(spec, use_ray=False) as cluster:
        decode = cluster.instances["decode-0"].ranks[0]
        kv, peak, done = decode.worker.engine.kv, [0], threading.Event()

        def watch():
            while not done.wait(0.001):
                for blocks in list(kv.req_to_blocks.values()):
                    peak[0] = max(peak[0], sum(b.block_id != 0 for b in blocks))

        threading.Thread(target=watch, daemon=True).start()
        streams = cluster.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                   timeout_s=600)
        done.set()
        assert streams[0].error is None, streams[0].error
        mc, bs = decode.runner.model_config, decode.runner.block_size
        per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
        got = decode.receiver.stats["bytes_received"]
        return {"bytes_transferred": got, "tokens_transferred": got // per_token, "decode_blocks_held_peak": peak[0],
                "block_size": bs, "decode_kv_bytes_held_peak": peak[0] * bs * per_token,
                "blocks_freed_while_decoding": kv.num_window_freed,
                "mistral_7b_bytes_transferred": got // per_token * MISTRAL_7B_KV_BYTES_PER_TOKEN,
                "mistral_7b_kv_bytes_held_peak": peak[0] * bs * MISTRAL_7B_KV_BYTES_PER_TOKEN}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    max_len = args.prompt_len + args.max_tokens + 64
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("window", args.window), ("full", None)):
            results[name] = measure(save_model(Path(tmp) / name, window, max_len), args.prompt_len, args.max_tokens,
                                    args.block_size)
    results["config"] = vars(args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name in ("window", "full"):
            r = results[name]
            print(f"{name:6s}: {r['tokens_transferred']} tokens shipped ({r['bytes_transferred']} B; Mistral 7B "
                  f"{r['mistral_7b_bytes_transferred'] / 2**20:.1f} MiB), decode peak {r['decode_blocks_held_peak']} "
                  f"blocks of {r['block_size']} (Mistral 7B {r['mistral_7b_kv_bytes_held_peak'] / 2**20:.1f} MiB), "
                  f"{r['blocks_freed_while_decoding']} blocks freed while decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
