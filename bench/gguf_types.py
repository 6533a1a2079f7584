"""Every GGUF tensor type llama.cpp's quantizer writes, loaded and run: load time and decode step
time, with the file's 4-bit codes (`--quantization auto`: int4 where the type allows) against
every weight dequantized at load (`none`).

    python -m bench.gguf_types                                  # 1024 wide, 4 layers, every type
    python -m bench.gguf_types --types Q4_K,Q6_K,Q4_K_M --layers 8 --json

For each type, a random Llama is written with every decoder linear of that type (random blocks:
fp16 scales of a sane size, random codes; speed does not depend on the values), embeddings and
head F16, norms F32; and `Q4_K_M`, the mix llama.cpp writes under that name (Q4_K, but Q6_K for
attn_v and ffn_down in the layers its `use_more_bits` picks, and for the head). Each file is
loaded twice with an empty cache folder: the first load converts it (gguf-py's dequantization)
and writes the cache, the second reads the cache. Then decode steps at batches 1 and 8 (ms per
step, bench/decode_steps.py). Alternate runs, never compare with an older table: the machine drifts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# byte offsets of each block type's fp16 scale fields (ggml-common.h block_* structs)
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
VOCAB = 40960  # bench/decode_steps.py's prompts are ids below 40000 (bench/offline.py TOKEN_ID_RANGE)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """A (out, in) tensor of type `kind` as its raw bytes (float types: the values): random codes,
    and fp16 scale fields drawn so that the weights' standard deviation is about `std`."""
    if kind in ("F32", "F16", "BF16"):
        w = (rng.standard_normal(shape) * std).astype(np.float32)
        return gguf.quants.quantize(w, Q.BF16) if kind == "BF16" else w.astype(np.float16) if kind == "F16" else w
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    if shape[1] % block:
        raise ValueError(f"{kind} needs rows of a multiple of {block} weights, not {shape[1]}")
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)

    def set_scales(scale: float) -> None:
        for offset in _FP16_FIELDS[kind]:
            d = (scale * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
            raw[..., offset:offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    set_scales(1.0)  # the weights scale with every scale field together: measure at 1, then set
    set_scales(std / float(gguf.quants.dequantize(raw.reshape(shape[0], -1), Q[kind]).std()))
    return raw.reshape(shape[0], -1)


def q4_k_m_types(num_layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M choice (llama-quant.cpp): Q6_K for attn_v and ffn_down of the layers
    `use_more_bits` picks (the first and last eighth, and every third between), Q4_K elsewhere."""
    def more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2
    types = {"output": "Q6_K", "token_embd": "Q4_K"}
    for i in range(num_layers):
        for name in LINEARS:
            types[f"blk.{i}.{name}"] = "Q6_K" if name in ("attn_v", "ffn_down") and more_bits(i) else "Q4_K"
    return types


def write_llama_gguf(path: Path, types: dict[str, str], hidden: int, ffn: int, layers: int, heads: int,
                     kv_heads: int, vocab: int, seed: int = 0) -> Path:
    """A random Llama GGUF: each tensor of the type `types` gives its base name (default: linears
    F16, norms F32, embeddings and head F16)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    shapes = {"token_embd": (vocab, hidden), "output": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_v": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                   f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
                   f"blk.{i}.ffn_down": (hidden, ffn)}
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", layers), ("context_length", 4096), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", vocab)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_name(path.stem)
    writer.add_tokenizer_model("gpt2")  # a vocabulary of placeholders: the engine wants a tokenizer
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_merges([])
    for name, shape in shapes.items():
        kind = types.get(name, "F16")
        data = random_blocks(kind, shape, rng)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
    for name in ["output_norm", *(f"blk.{i}.{n}" for i in range(layers) for n in ("attn_norm", "ffn_norm"))]:
        writer.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _measure(path: Path, quantization: str, cache: Path, batches: list[int], steps: int, dtype: str) -> dict:
    import os

    from bench.decode_steps import step_times
    from decode_worker.llm import LLM
    from engine.quant import gguf_file
    os.environ["PDSERVE_CACHE_DIR"] = str(cache)
    row = {}
    for load in ("first_load_s", "cached_load_s"):
        gguf_file.forget_open_readers()  # each load parses the file, as a new process would
        start = time.perf_counter()
        llm = LLM(model=str(path), dtype=dtype, quantization=quantization)
        row[load] = round(time.perf_counter() - start, 2)
        if load == "first_load_s":
            del llm
    row["linear_layers"] = llm.engine.runner.linear_layers
    row |= {f"ms_per_step_b{n}": round(ms, 2) for n, ms in step_times(llm, batches, steps, 32).items()}
    return row


def run(types: list[str], widths: dict, batches: list[int], steps: int, dtype: str) -> list[dict]:
    rows = []
    for kind in types:
        with tempfile.TemporaryDirectory() as tmp:
            layer_types = (q4_k_m_types(widths["layers"]) if kind == "Q4_K_M" else
                           {f"blk.{i}.{n}": kind for i in range(widths["layers"]) for n in LINEARS})
            path = write_llama_gguf(Path(tmp) / f"{kind}.gguf", layer_types, **widths)
            for quantization in ("auto", "none"):
                row = _measure(path, quantization, Path(tmp) / f"cache-{quantization}", batches, steps, dtype)
                rows.append({"type": kind, "quantization": quantization, **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict], batches: list[int]) -> str:
    head = ["type", "quantization", "first load s", "cached load s", *(f"ms/step b{n}" for n in batches), "linears"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["type"], r["quantization"], r["first_load_s"], r["cached_load_s"],
                 *(r[f"ms_per_step_b{n}"] for n in batches), r["linear_layers"][:90]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--types", default=",".join((*TYPES, "Q4_K_M")), help="comma-separated GGUF types, or Q4_K_M")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args(argv)
    widths = dict(hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=args.hidden // 64,
                  kv_heads=max(1, args.hidden // 256), vocab=VOCAB)
    batches = [int(b) for b in args.batches.split(",")]
    rows = run(args.types.split(","), widths, batches, args.steps, args.dtype)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows, batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
