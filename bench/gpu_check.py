"""One prepared check of the engine on a CUDA machine; prints one JSON object on stdout.

    python -m bench.gpu_check                        # on a machine with a CUDA device
    python -m bench.gpu_check --device cpu --batch-sizes 1 --output-len 4    # dry run of the script itself

Checks, each recorded separately so that one failure does not hide the others:
  (a) attention backend: `auto` must pick flash_attn when it is importable, torch otherwise;
  (b) correctness: last-position logits of a few prompts, and 32 greedy tokens through `LLM`, of the
      `auto` engine against the same model with attention_backend="torch" on the same device;
  (c) whether torch.distributed has NCCL;
  (d) decode ms/step through `LLM` at batch 1, 32 and 128 (128-token prompts, 64 output tokens).

Without a CUDA device (and no --device) it prints {"cuda": false, ...} and exits 0. Logs go to stderr.
Exit status 1 means some check raised; its entry holds the error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
import traceback

import torch

from bench.offline import random_prompts
from decode_worker.engine import ColocatedEngine
from decode_worker.llm import LLM
from engine.attention import flash_attn_available
from engine.batch import NewRequestData, SchedulerOutput
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from engine.request import SamplingParams

logger = logging.getLogger("bench.gpu_check")

CHECK_PROMPT_LENS = (7, 128, 300, 1000)  # mixed lengths: short, one block, several blocks


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def build_runner(device: str, backend: str, memory_gib: float) -> ModelRunner:
    """SmolLM2 in bf16 on `device` through the engine's own runner."""
    return ModelRunner(EngineConfig(device=device, dtype="bfloat16", attention_backend=backend,
                                    cache=CacheConfig(memory_gib=memory_gib)))


def llm_over(runner: ModelRunner, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048) -> LLM:
    """An `LLM` whose engine reuses `runner` (its weights and KV pool), with a fresh scheduler."""
    cfg = EngineConfig(device=runner.config.device, dtype="bfloat16", attention_backend=runner.config.attention_backend,
                       cache=runner.config.cache,
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens))
    return LLM(engine=ColocatedEngine(cfg, runner=runner))


def check_backend(runner: ModelRunner) -> dict:
    """(a) Which attention backend `auto` runs, and whether that is the expected one."""
    expected = "flash_attn" if runner.device.type == "cuda" and flash_attn_available() else "torch"
    info = {"flash_attn_importable": flash_attn_available(), "auto_picked": runner.backend.name,
            "expected": expected, "ok": runner.backend.name == expected, "block_size": runner.block_size}
    if info["flash_attn_importable"]:
        import flash_attn
        info["flash_attn_version"] = getattr(flash_attn, "__version__", None)
    return info


def last_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefills all prompts in one step straight through the runner; returns (num_prompts, vocab) fp32."""
    bs, next_block, new = runner.block_size, 1, []  # block 0 is the null block
    for i, p in enumerate(prompts):
        n = -(-len(p) // bs)
        new.append(NewRequestData(f"check-{i}", p, 0, list(range(next_block, next_block + n)), _greedy(1), True))
        next_block += n
    assert next_block <= runner.num_blocks, "the KV pool is too small for the check prompts"
    sched = SchedulerOutput(new_requests=new)
    runner.update_states(sched)
    logits = runner.execute_model(runner.prepare_inputs(sched))
    runner.update_states(SchedulerOutput(finished_req_ids=[r.request_id for r in new]))
    return logits.float()


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_correctness(auto: ModelRunner, ref: ModelRunner, num_tokens: int) -> dict:
    """(b) The auto engine against attention_backend="torch": logits, then greedy tokens."""
    prompts = [random_prompts(1, n, seed=100 + n)[0] for n in CHECK_PROMPT_LENS]
    got, want = last_logits(auto, prompts), last_logits(ref, prompts)
    diff = (got - want).abs().amax(dim=-1)  # (num_prompts,)
    same_argmax = (got.argmax(-1) == want.argmax(-1)).tolist()

    outs = [[o.token_ids for o in llm_over(r).generate(prompts, _greedy(num_tokens))] for r in (auto, ref)]
    prefixes = [_common_prefix(a, b) for a, b in zip(*outs)]
    return {"prompt_lens": list(CHECK_PROMPT_LENS), "logits_max_abs_diff": diff.tolist(),
            "logits_max_abs": want.abs().amax(dim=-1).tolist(), "argmax_equal": same_argmax,
            "greedy_tokens": num_tokens, "greedy_equal_prefix_len": prefixes,
            "greedy_all_equal": all(p == num_tokens for p in prefixes)}


def check_nccl() -> dict:
    """(c) NCCL in this torch build (a TP or KV-transfer run over NCCL needs it)."""
    import torch.distributed as dist
    info = {"distributed_available": dist.is_available()}
    info["nccl_available"] = bool(info["distributed_available"] and dist.is_nccl_available())
    if info["nccl_available"] and torch.cuda.is_available():
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def decode_speed(runner: ModelRunner, batch: int, prompt_len: int, output_len: int) -> dict:
    """(d) `batch` requests prefilled in one step, then `output_len - 1` decode steps.

    The token budget fits every prompt in the first step, so all requests decode together from
    the second step on and (finished - first token) / (tokens - 1) is the batch's decode step.
    """
    llm = llm_over(runner, max_num_seqs=max(batch, 128), max_num_batched_tokens=max(2048, batch * prompt_len))
    llm.generate(random_prompts(batch, prompt_len, seed=1000 + batch), _greedy(4))  # warm-up: kernels, allocator
    start = time.perf_counter()
    outs = llm.generate(random_prompts(batch, prompt_len, seed=2000 + batch), _greedy(output_len))
    wall_s = time.perf_counter() - start
    steps = [(o.finished_s - o.first_token_s) / (len(o.token_ids) - 1) * 1000 for o in outs]
    ttfts = [o.ttft_s for o in outs]
    return {"batch": batch, "ms_per_step": statistics.median(steps), "ms_per_step_max": max(steps),
            "ttft_mean_s": statistics.fmean(ttfts), "output_tok_s": sum(len(o.token_ids) for o in outs) / wall_s}


def _attempt(result: dict, key: str, fn, *args) -> None:
    """Runs one check into result[key]; an exception is recorded there instead of ending the script."""
    start = time.perf_counter()
    try:
        result[key] = fn(*args)
    except Exception as e:  # noqa: BLE001 -- one failed check must not lose the others' results
        logger.error("check %s failed:\n%s", key, traceback.format_exc())
        result[key] = {"error": f"{type(e).__name__}: {e}"}
    logger.info("check %s (%.1f s): %s", key, time.perf_counter() - start, json.dumps(result[key]))


def device_info(device: str) -> dict:
    info = {"cuda": torch.cuda.is_available(), "device": device, "torch_version": torch.__version__,
            "torch_cuda": torch.version.cuda}
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
    return info


def run_checks(args: argparse.Namespace) -> dict:
    result = device_info(args.device)
    auto = build_runner(args.device, "auto", args.memory_gib)
    ref = build_runner(args.device, "torch", args.memory_gib)
    _attempt(result, "attention_backend", check_backend, auto)
    _attempt(result, "correctness", check_correctness, auto, ref, args.greedy_tokens)
    _attempt(result, "nccl", check_nccl)
    del ref
    result["decode"] = {}
    for b in args.batch_sizes:
        _attempt(result["decode"], f"batch_{b}", decode_speed, auto, b, args.prompt_len, args.output_len)
    if args.device.startswith("cuda"):
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _has_error(node) -> bool:
    if isinstance(node, dict):
        return "error" in node or any(_has_error(v) for v in node.values())
    return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when present; cpu only dry-runs this script")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--memory-gib", type=float, default=4.0, help="KV pool of each of the two engines")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.device is None:
        if not torch.cuda.is_available():
            logger.warning("no CUDA device: nothing to check (torch %s, built with CUDA %s)",
                           torch.__version__, torch.version.cuda)
            print(json.dumps({"cuda": False, "torch_version": torch.__version__, "torch_cuda": torch.version.cuda,
                              "reason": "torch.cuda.is_available() is False"}))
            return 0
        args.device = "cuda"
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON object only
        result = run_checks(args)
    print(json.dumps(result))
    return 1 if _has_error(result) else 0


if __name__ == "__main__":
    sys.exit(main())
