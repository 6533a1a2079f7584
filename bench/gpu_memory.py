"""The `memory` section of bench/gpu_check.py: the KV budget of engine/runner/kv_budget.py on a real
device. An 8B-shaped Llama (Llama-3-8B's shape, all 32 layers, random bf16 weights made on the
device), the torch attention backend (whose decode gathers every row's whole context, and which
runs CUDA graphs), gpu_memory_utilization 0.9, max_model_len 8192, 128 sequences, 4096-token steps:

    budget     the breakdown the runner measured (context, non-torch, weights, activations of
               the prefill and decode profiles, graphs reserved, free), its KV and blocks
    ladder     decode steps at the longest context with the pool and graphs in place, growing
               batches up to max_num_seqs: which ran, and the largest one without running out
    reserved   torch.cuda.max_memory_reserved over the ladder against what the budget lets torch
               hold (share less context and non-torch), and the device's free memory at the end

`memory(plan)` takes bench/gpu_sections.py's Plan: on its CPU stand-in (`--dry-run`) the same code
path runs on a 2-layer tiny Llama with a pretend device (StandInMemory: 1 GiB, a 64 MiB context,
gpu_memory_utilization 0.07 so that the pool stays a few MiB) and batches of 1 and 4. Its limit
in gpu_check is 65 s (weights ~5 s, the context probe ~5 s, graph capture the most).
"""
from __future__ import annotations

import torch

from bench.gpu_sections import Plan, _random_weights, engine_config, model_config_of
from engine.runner.kv_budget import MemoryBudget

GiB, MiB = 1 << 30, 1 << 20
GPU_UTILIZATION, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 0.9, 8192, 128, 4096
LADDER = (1, 16, 32, 64, 96, 128)


class StandInMemory:
    """A pretend device for the CPU dry run (engine/runner/device_memory.py DeviceMemory): `total` bytes,
    a `context`, and nothing of this process's tensors seen (reserved and peak stay 0)."""

    def __init__(self, total: int = GiB, context: int = 64 * MiB):
        self.total_bytes, self.context_bytes = total, context

    def total(self) -> int:
        return self.total_bytes

    def free(self) -> int:
        return self.total_bytes - self.context_bytes

    def reserved(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def context(self) -> int:
        return self.context_bytes


def budget_gib(b: MemoryBudget) -> dict:
    """The budget's breakdown in GiB, and its blocks."""
    gib = {"total": b.total, "share_of_total": b.utilization * b.total, "context": b.context, "non_torch": b.non_torch,
           "weights": b.weights, "activations": b.activations, "prefill_activations": b.prefill_peak - b.weights,
           "decode_activations": b.decode_peak - b.weights, "graphs_reserved": b.graphs, "used": b.used,
           "free_after_profile": b.free, "other_processes": b.others, "share": b.share, "headroom": b.headroom,
           "kv": b.kv_bytes}
    return {**{f"{k}_gib": round(v / GiB, 3) for k, v in gib.items()}, "kv_blocks": b.num_blocks,
            "limited_by": "share" if b.share <= b.headroom else "free", "profiled": {
                "prefill_tokens": b.prefill_tokens, "decode_seqs": b.decode_seqs, "context_len": b.context_len,
                "decode_context": b.decode_context}}


def decode_ladder(runner, batches: tuple[int, ...]) -> dict:
    """Decode steps of each batch at the runner's longest context (profile_step: the runner's pool
    stays allocated beside the step's scratch pool), smallest first, until one runs out of memory.
    Each rung starts from an emptied allocator cache, as the budget's profile does: the first GPU
    run let each rung's cached segments pile up under the next (peak 130.4 GiB at 128 against 125.1
    allowed), which measured the cache, not a step. `reserved_before_gib`: what the cache held from
    the rungs before, ahead of emptying it."""
    mem, length, out = runner.device_memory, runner.max_model_len, {}
    cuda = runner.device.type == "cuda"
    for b in batches:
        before = mem.reserved()
        mem.empty_cache()
        mem.reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats(runner.device)
        try:
            runner.profile_step(b, 1, length)
        except torch.OutOfMemoryError as exc:
            mem.empty_cache()
            out[str(b)] = {"ok": False, "error": str(exc).splitlines()[0][:300]}
            break
        out[str(b)] = {"ok": True, "peak_reserved_gib": round(mem.peak() / GiB, 3),
                       "reserved_before_gib": round(before / GiB, 3)}
        if cuda:
            out[str(b)]["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(runner.device) / GiB, 3)
    return out


def memory(plan: Plan) -> dict:
    from transformers import LlamaConfig

    from engine.runner.model_runner import ModelRunner
    cuda = plan.device.startswith("cuda")
    dry = dict(utilization=0.07, max_model_len=512, max_num_seqs=4, ladder=(1, 4))
    knobs = dict(utilization=GPU_UTILIZATION, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                 ladder=LADDER) if cuda else dry
    cfg_hf = LlamaConfig(**plan.big, max_position_embeddings=knobs["max_model_len"], rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    cfg = engine_config(plan.device, dict(gpu_memory_utilization=knobs["utilization"], block_size=16), "torch",
                        knobs["max_num_seqs"], MAX_NUM_BATCHED_TOKENS)
    runner = ModelRunner(cfg, model_config=model_config_of(cfg_hf, "random-8b-shape"),
                         weights=_random_weights(cfg_hf, plan.device), device_memory=None if cuda else StandInMemory())
    mem, budget = runner.device_memory, runner.memory_budget
    out = {"shape": plan.big, "backend": runner.backend.name, "cuda_graphs": runner.graphs is not None,
           "gpu_memory_utilization": knobs["utilization"], "max_model_len": runner.max_model_len,
           "block_size": runner.block_size, "budget": budget_gib(budget),
           "kv_pool_gib": round(runner.kv_cache.numel() * runner.kv_cache.element_size() / GiB, 3)}
    if not cuda:
        out["device_memory"] = "StandInMemory: 1 GiB, 64 MiB context, no tensors seen"
    out["ladder"] = ladder = decode_ladder(runner, knobs["ladder"])
    ok = [int(b) for b, r in ladder.items() if r["ok"]]
    out["largest_decode_batch_at_max_model_len"] = max(ok, default=0)
    # what the budget lets torch's allocator hold: the share, less what the process holds outside it
    allowed = budget.utilization * budget.total - budget.context - budget.non_torch
    peak = max((r["peak_reserved_gib"] for r in ladder.values() if r["ok"]), default=0.0)
    out["reserved"] = {"max_over_ladder_gib": peak, "allowed_gib": round(allowed / GiB, 3),
                       "within_budget": peak * GiB <= allowed, "free_at_end_gib": round(mem.free() / GiB, 3)}
    return out
