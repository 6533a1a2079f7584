"""The `speculative` section of bench/gpu_check.py: speculative decoding (engine/speculative) on the
device.

    tokens     a small random Llama in float32 on the torch attention backend (written to a temporary
               folder: the draft model is loaded from one), 8 prompts that repeat themselves, 32
               greedy tokens each (the CPU stand-in: 2 layers, 4 prompts, 12 tokens): plain
               decoding against the n-gram proposer, the target as its own draft and a random
               EAGLE-3 head (bench/eagle3_head.py: its drafts next to never kept); per
               method the prompts whose tokens are equal (else the first difference and the plain
               run's top-2 logprob gap there), the drafts proposed and accepted (the target as
               its own draft must accept every one), and the seconds each run took; on the
               device the draft's run sizes both KV pools from the device's memory
               (gpu_memory_utilization 0.3, the draft's weights and pool counted in: draft_pools)
    profile    on the ~8B shape (bench/gpu_sections.py decode), the step times speculation's
               on/off decision reads (engine/speculative/profile.py), in the decode section's
               process: see gpu_sections.decode

Its limit in gpu_check is LIMIT_S.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.eagle3_head import save_eagle3_head
from bench.gpu_sections import TINY, Plan, engine_config, sharpened

LIMIT_S = 45
_pools: dict = {}  # device -> the draft run's pool sizes
SHAPE = dict(TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
DRY_SHAPE = dict(TINY, num_hidden_layers=2)  # the CPU stand-in's, with 4 prompts of 12 tokens


def _save_target(folder: Path, shape: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    cfg = LlamaConfig(**shape, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    sharpened(LlamaForCausalLM(cfg).eval()).save_pretrained(folder, safe_serialization=True)
    return folder


def _run(path: Path, device: str, spec, prompts: list[list[int]], max_tokens: int, kv: dict | None = None):
    """The prompts' greedy outputs through a colocated engine with `spec` (None: plain), its seconds,
    and its speculator."""
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    from engine.runner.model_runner import ModelRunner
    cfg = replace(engine_config(device, kv or dict(num_blocks=512, block_size=16), "torch", max_num_seqs=8),
                  model=str(path), dtype="float32", speculative=spec)
    engine = ColocatedEngine(cfg, runner=ModelRunner(cfg))
    if engine.runner.draft is not None:  # its pool: as many blocks as the target's, within the budget
        _pools[device] = {"kv_blocks": engine.runner.num_blocks, "draft_kv_blocks": engine.runner.draft.num_blocks,
                          "budget": engine.runner.memory_budget.describe() if engine.runner.memory_budget else None}
    start = time.monotonic()
    outs = LLM(engine=engine).generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                               logprobs=2))
    return outs, time.monotonic() - start, engine.speculator


def _compare(plain, got) -> dict:
    rows = []
    for p, g in zip(plain, got):
        if p.token_ids == g.token_ids:
            continue
        j = next(i for i, (a, b) in enumerate(zip(p.token_ids, g.token_ids)) if a != b)
        top = sorted(p.logprobs[j].values(), reverse=True)
        rows.append({"first_difference": j, "plain_top2_gap": top[0] - top[1]})
    return {"prompts_equal": len(plain) - len(rows), "num_prompts": len(plain), "differences": rows}


def speculative(plan: Plan) -> dict:
    from engine.core.speculative_config import SpeculativeConfig
    cuda = plan.device.startswith("cuda")
    shape, lengths, max_tokens = (SHAPE, (5, 9, 13, 17) * 2, 32) if cuda else (DRY_SHAPE, (5, 9, 13, 17), 12)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() * 4 for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_target(Path(tmp) / "target", shape)
        head = save_eagle3_head(Path(tmp) / "head", json.loads((path / "config.json").read_text()), seed=0,
                                draft_vocab=64, aux_ids=[1, shape["num_hidden_layers"] // 2, 0])
        plain, plain_s, _ = _run(path, plan.device, None, prompts, max_tokens)
        out = {"shape": shape, "dtype": "float32", "backend": "torch", "plain_s": plain_s, "methods": {}}
        # on the device, the draft's run sizes the pools from the device's memory (the draft counted in)
        sized = dict(gpu_memory_utilization=0.3, block_size=16) if cuda else None
        for name, spec, kv in (("ngram", SpeculativeConfig("ngram", 3, max_batch_size=8), None),
                               ("draft_self", SpeculativeConfig("draft_model", 3, model=str(path), max_batch_size=8),
                                sized),
                               ("eagle3_random", SpeculativeConfig("eagle3", 3, model=str(head), max_batch_size=8),
                                None)):
            got, seconds, s = _run(path, plan.device, spec, prompts, max_tokens, kv)
            out["methods"][name] = {**_compare(plain, got), "seconds": seconds, "proposed": s.proposed,
                                    "accepted": s.accepted}
        out["draft_pools"] = _pools.get(plan.device)
        if cuda:
            out["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    self_draft = out["methods"]["draft_self"]
    out["ok"] = all(m["prompts_equal"] == m["num_prompts"] or all(d["plain_top2_gap"] < 1e-3 for d in m["differences"])
                    for m in out["methods"].values()) and self_draft["accepted"] == self_draft["proposed"]
    return out


def verify_profile(runner) -> dict:
    """The decode and verify step times (3 drafts) per batch size, and where 1 or 2 accepted drafts
    per step stop paying (engine/speculative/profile.py)."""
    from engine.speculative.profile import measure_verify
    p = measure_verify(runner, 3)
    return {"batch_sizes": list(p.batch_sizes), "decode_ms": [round(s * 1e3, 3) for s in p.decode_s],
            "verify_ms": [round(s * 1e3, 3) for s in p.verify_s],
            "max_batch_at_1_accepted": p.max_batch_size(1.0), "max_batch_at_2_accepted": p.max_batch_size(2.0)}
