"""Offline throughput: pdserve's `LLM` against transformers' `generate` and llama.cpp on the same GGUF.

    python -m bench.offline                  # W1: 32 requests x 128 prompt / 128 output tokens, 2 threads
    python -m bench.offline --json           # one JSON object on stdout; logs go to stderr
    python -m bench.offline --skip-hf --skip-llamacpp --num-requests 4 --output-len 8
    python -m bench.offline --dtype float32 --quantization int8 --hf-dtype float32

pdserve runs its defaults (`--dtype auto --quantization auto`: what the engine picks on this
machine; the JSON's `pdserve_config` says what that was); transformers runs the GGUF as it
loads GGUF files, dequantized (fp32 unless `--hf-dtype`); llama.cpp runs the file as it is
(batch 1 only; bench/llamacpp.py, skipped with a log line when llama-cpp-python is missing).
All greedy with EOS ignored, so every request produces exactly `output_len` tokens. pdserve
runs the requests through continuous batching; transformers runs them as one batch of
equal-length prompts (no padding). Batch-1 decode speed excludes the prefill everywhere:
pdserve and llama.cpp measure from the first token to the last, transformers subtracts a
1-token run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from engine.attention import BACKENDS
from engine.core.config import QUANTIZATION_CHOICES, parse_dtype
from engine.core.request import SamplingParams

logger = logging.getLogger("bench.offline")

# Random prompt ids come from this range: inside SmolLM2's 49152-token vocab, clear of the
# special tokens at the bottom, so no prompt contains an EOS or a chat marker.
TOKEN_ID_RANGE = (100, 40000)


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    prompt_len: int = 128
    output_len: int = 128
    batch1_output_len: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch1_output_len < 2:
            raise ValueError(f"batch1_output_len must be >= 2 (one decode step), got {self.batch1_output_len}")


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(*TOKEN_ID_RANGE, (num, length), generator=g).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def bench_pdserve(wl: Workload, dtype: str, threads: int, quantization: str = "auto",
                  attention_backend: str = "auto", batch_invariant: bool = False) -> dict:
    """W1 through `LLM.generate`, after a small warm-up; then one batch-1 request.

    Warm-up and batch-1 prompts use their own seeds, so none of them hits the prefix cache.
    """
    from decode_worker.llm import LLM
    llm = LLM(model="smollm2", dtype=dtype, num_threads=threads, quantization=quantization,
              attention_backend=attention_backend, batch_invariant=batch_invariant)
    llm.generate(random_prompts(2, wl.prompt_len, wl.seed + 1), _greedy(4))

    prompts = random_prompts(wl.num_requests, wl.prompt_len, wl.seed)
    start = time.perf_counter()
    outs = llm.generate(prompts, _greedy(wl.output_len))
    wall_s = time.perf_counter() - start
    num_out = sum(len(o.token_ids) for o in outs)
    assert num_out == wl.num_requests * wl.output_len, "EOS is ignored, so every request runs to max_tokens"
    ttfts = [o.ttft_s for o in outs]

    (one,) = llm.generate(random_prompts(1, wl.prompt_len, wl.seed + 2), _greedy(wl.batch1_output_len))
    ms_per_step = (one.finished_s - one.first_token_s) / (len(one.token_ids) - 1) * 1000
    logger.info("pdserve: %d tokens in %.2f s, batch-1 %.2f ms/step", num_out, wall_s, ms_per_step)
    runner = llm.engine.runner
    config = {"dtype": str(runner.dtype).removeprefix("torch."), "quantization": quantization,
              "linear_layers": runner.linear_layers, "attention": runner.backend.name,
              "batch_invariant": batch_invariant}
    return {"pdserve_output_tok_s": num_out / wall_s, "pdserve_wall_s": wall_s,
            "pdserve_batch1_ms_per_step": ms_per_step, "pdserve_config": config,
            "pdserve_ttft_mean_s": statistics.fmean(ttfts), "pdserve_ttft_p50_s": statistics.median(ttfts)}


def load_hf_model(dtype: str):
    """transformers' Llama from the same GGUF file pdserve loads (dequantized to `dtype`)."""
    from transformers import AutoModelForCausalLM
    from engine.loading.loader import resolve_model_path
    path = resolve_model_path("smollm2")
    # NOTE: transformers 5 renamed `torch_dtype` to `dtype`.
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=parse_dtype(dtype))
    return model.eval()


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], num_new: int) -> tuple[float, int]:
    """Greedy `generate` of exactly `num_new` tokens for one batch; returns (seconds, output tokens)."""
    input_ids = torch.tensor(prompts)
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_new,
                         min_new_tokens=num_new, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return elapsed, out[:, input_ids.shape[1]:].numel()


def bench_hf(wl: Workload, dtype: str) -> dict:
    """W1 as one batch of equal-length prompts; batch-1 decode = (t(n tokens) - t(1 token)) / (n - 1)."""
    model = load_hf_model(dtype)
    _hf_generate(model, random_prompts(2, wl.prompt_len, wl.seed + 1), 4)  # warm-up, as for pdserve

    wall_s, num_out = _hf_generate(model, random_prompts(wl.num_requests, wl.prompt_len, wl.seed), wl.output_len)
    assert num_out == wl.num_requests * wl.output_len

    one = random_prompts(1, wl.prompt_len, wl.seed + 2)
    t_1, _ = _hf_generate(model, one, 1)
    t_n, _ = _hf_generate(model, one, wl.batch1_output_len)
    ms_per_step = (t_n - t_1) / (wl.batch1_output_len - 1) * 1000
    logger.info("transformers: %d tokens in %.2f s, batch-1 %.2f ms/step", num_out, wall_s, ms_per_step)
    return {"hf_output_tok_s": num_out / wall_s, "hf_wall_s": wall_s, "hf_batch1_ms_per_step": ms_per_step}


def machine_info() -> dict:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "cpus_usable": affinity, "python": platform.python_version(),
            # other processes on a shared machine skew every number; the load average flags it
            "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def run(wl: Workload, dtype: str, threads: int, skip_hf: bool, quantization: str = "auto",
        hf_dtype: str = "float32", skip_llamacpp: bool = False, attention_backend: str = "auto",
        batch_invariant: bool = False) -> dict:
    """Every measurement in one process, pdserve first; returns the flat result dict. `dtype` and
    `quantization` are pdserve's; transformers runs `hf_dtype`, unquantized."""
    torch.set_num_threads(threads)
    result = {"workload": {**asdict(wl), "temperature": 0.0, "ignore_eos": True, "dtype": dtype, "hf_dtype": hf_dtype,
                           "quantization": quantization, "attention_backend": attention_backend, "batch_invariant": batch_invariant,
                           "token_id_range": list(TOKEN_ID_RANGE)},
              "threads": threads, "torch_version": torch.__version__, "machine": machine_info()}
    result.update(bench_pdserve(wl, dtype, threads, quantization, attention_backend, batch_invariant))
    if skip_hf:
        result.update(hf_output_tok_s=None, hf_batch1_ms_per_step=None)
    else:
        import transformers
        result["transformers_version"] = transformers.__version__
        result.update(bench_hf(wl, hf_dtype))
    from bench.llamacpp import bench_llamacpp, llamacpp_unavailable
    why = "--skip-llamacpp" if skip_llamacpp else llamacpp_unavailable()
    if why is None:
        result.update(bench_llamacpp(random_prompts(1, wl.prompt_len, wl.seed + 2)[0], wl.batch1_output_len, threads))
    else:
        logger.info("llama.cpp not measured: %s", why)
        result["llamacpp_batch1_ms_per_step"] = None
    if hasattr(os, "getloadavg"):
        result["machine"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    return result


def _fmt(value, unit: str) -> str:
    return "-" if value is None else f"{value:.2f} {unit}"


def format_table(r: dict) -> str:
    wl = r["workload"]
    ratio = (r["pdserve_output_tok_s"] / r["hf_output_tok_s"]) if r["hf_output_tok_s"] else None
    lines = [
        f"workload: {wl['num_requests']} requests x {wl['prompt_len']} prompt / {wl['output_len']} output tokens, "
        f"greedy, EOS ignored, pdserve dtype {wl['dtype']} quantization {wl['quantization']}, "
        f"transformers {wl['hf_dtype']}, "
        f"{r['threads']} threads, torch {r['torch_version']}",
        f"machine:  {r['machine']['platform']}, {r['machine']['cpu_count']} CPUs, "
        f"load average {r['machine']['loadavg_1m_at_start']} at start",
        "",
        f"{'metric':<28}{'pdserve':>16}{'transformers':>16}",
        f"{'output throughput':<28}{_fmt(r['pdserve_output_tok_s'], 'tok/s'):>16}"
        f"{_fmt(r['hf_output_tok_s'], 'tok/s'):>16}",
        f"{'batch-1 decode':<28}{_fmt(r['pdserve_batch1_ms_per_step'], 'ms/step'):>16}"
        f"{_fmt(r['hf_batch1_ms_per_step'], 'ms/step'):>16}",
        f"{'llama.cpp batch-1 decode':<28}{_fmt(r['llamacpp_batch1_ms_per_step'], 'ms/step'):>16}",
        f"{'pdserve ran':<28}{r['pdserve_config']['dtype']}, {r['pdserve_config']['linear_layers']}",
        f"{'TTFT mean / p50':<28}{r['pdserve_ttft_mean_s']:>9.2f} / {r['pdserve_ttft_p50_s']:.2f} s",
        f"{'throughput pdserve / hf':<28}{'-' if ratio is None else f'{ratio:.2f}x':>16}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=64, help="output tokens of the batch-1 request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="pdserve's (auto: what the engine picks here)")
    p.add_argument("--hf-dtype", default="float32", choices=["bfloat16", "float32", "float16"],
                   help="transformers' (float32: what it makes of a GGUF)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="pdserve's linear layers (docs/engine.md, Linear methods); transformers stays unquantized")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="pdserve's")
    p.add_argument("--batch-invariant", action="store_true", help="pdserve's batch-invariant mode")
    p.add_argument("--skip-hf", action="store_true", help="do not measure transformers")
    p.add_argument("--skip-llamacpp", action="store_true", help="do not measure llama.cpp")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    wl = Workload(args.num_requests, args.prompt_len, args.output_len, args.batch1_output_len, args.seed)
    # NOTE: libraries that print keep stdout clean for --json: everything until the result goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(wl, args.dtype, args.threads, args.skip_hf, args.quantization, args.hf_dtype,
                     args.skip_llamacpp, args.attention_backend, args.batch_invariant)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
