"""The `flex` section of bench/gpu_check.py: the FlexAttention backend (engine/attention/flex_backend.py),
`auto`'s choice on a GPU without flash-attn, against the torch backend on the same device.

    tokens   greedy tokens of flex against torch, in float32, on tiny random Llama (GQA), Mistral
             (a sliding window) and Gemma 2 (soft-capped scores, sliding and global layers
             alternating) checkpoints: prompts past the windows, prefilled in chunks over cached
             context beside decodes. Any difference is a bug (float32, sharpened weights).
    decode   ms per decode step of each backend, eager (flex has no CUDA graphs), on an 8-layer cut of
             the ~8B shape at each batch, against the step time its bytes take at the measured copy
             bandwidth; and the seconds the first steps took (flex compiles each padded shape once).
    sinks    as tokens, on a tiny gpt-oss (attention sinks: flex's sink key in a graph of its own), last
             and only with the section's time left; skipped, and said so, where transformers has no
             gpt-oss.

Batches are skipped, and said so, once 80% of the section's time is gone: a compile slower than
expected leaves the tokens part standing. Its dry run: the CPU (inductor's C++ kernels), a
2-layer tiny Llama for the 8-layer cut.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import gpu_sections
from bench.gpu_sections import (Plan, _greedy, _prompts, _random_weights, _sync, bytes_bound_ms, copy_gbps, decode_ms,
                                engine_config, model_config_of, sharpened)

BACKENDS = ("flex", "torch")
FAMILIES = {  # transformers' config classes, scaled down; the published switches that change attention
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24, head_dim=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=32, sliding_window=24, attn_logit_softcapping=5.0,
                                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
}
TINY = dict(gpu_sections.TINY, num_hidden_layers=3, max_position_embeddings=1024)  # sliding, global, sliding
LIMIT_S = 65.0  # gpu_check's limit for this section (the time guard below works within it)


SINKS_FAMILIES = {"gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
    head_dim=32, sliding_window=24, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64))}


def _save_tiny(folder: Path, family: str, seed: int) -> Path:
    import transformers
    config_cls, model_cls, switches = {**FAMILIES, **SINKS_FAMILIES}[family]
    torch.manual_seed(seed)
    model = sharpened(getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**TINY, **switches})).eval())
    model.save_pretrained(folder / family, safe_serialization=True)
    return folder / family


def _tiny_llm(plan: Plan, folder: Path, backend: str):
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.runner.model_runner import ModelRunner
    cfg = engine_config(plan.device, dict(num_blocks=256, block_size=16), backend, max_num_seqs=8,
                        max_num_batched_tokens=64)  # prompts of 100 tokens prefill in chunks over their cache
    cfg = replace(cfg, model=str(folder), dtype="float32")
    return LLM(engine=ColocatedEngine(cfg, runner=ModelRunner(cfg)))


def tokens(plan: Plan, families=FAMILIES) -> dict:
    prompts = [p[:n] for p, n in zip(_prompts(4, 100, TINY["vocab_size"], 50), (100, 40, 7, 63))]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, family in enumerate(families):
            folder = _save_tiny(Path(tmp), family, seed)
            got = {b: [o.token_ids for o in _tiny_llm(plan, folder, b).generate(prompts, _greedy(16))]
                   for b in BACKENDS}
            out[family] = {"prompts_equal": sum(f == t for f, t in zip(got["flex"], got["torch"])),
                           "num_prompts": len(prompts)}
    return out


def decode(plan: Plan, deadline: float) -> dict:
    from transformers import LlamaConfig

    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.runner.model_runner import ModelRunner
    shape = dict(plan.big, num_hidden_layers=min(8, plan.big["num_hidden_layers"]))
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    mc = model_config_of(cfg, "random-8b-shape-cut")
    weights = dict(_random_weights(cfg, plan.device))  # both backends load the same
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    bw = copy_gbps(plan.device, min(2 << 30, weight_bytes))
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    out = {"shape": shape, "copy_GBps": bw, "batches": {}}
    kv = dict(memory_gib=plan.kv_gib, gpu_memory_utilization=plan.gpu_memory_utilization / 2, block_size=16)
    for backend in BACKENDS:
        ecfg = replace(engine_config(plan.device, kv, backend, max(plan.batch_sizes[:2]),
                                     max(2048, max(plan.batch_sizes[:2]) * plan.prompt_len)), enforce_eager=True)
        llm = LLM(engine=ColocatedEngine(ecfg, runner=ModelRunner(ecfg, model_config=mc, weights=weights.items())))
        for batch in plan.batch_sizes[:2]:
            row = out["batches"].setdefault(str(batch), {})
            if time.monotonic() > deadline:
                row[backend] = {"skipped": "the section's time guard"}
                continue
            ms, _, first_s = decode_ms(llm, batch, plan, mc.vocab_size)
            bound = bytes_bound_ms(weight_bytes, batch, plan.prompt_len + plan.output_len / 2, kv_per_token, bw)
            row[backend] = {"ms_per_step": ms, "first_run_s": first_s, "bytes_bound_ms": bound, "of_bound": bound / ms}
        del llm
        _sync(plan.device)
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def sinks(plan: Plan, deadline: float) -> dict:
    import transformers
    missing = [cls for cls, _, _ in SINKS_FAMILIES.values() if not hasattr(transformers, cls)]
    if missing:
        return {"skipped": f"transformers {transformers.__version__} has no {', '.join(missing)}"}
    if time.monotonic() > deadline:
        return {"skipped": "the section's time guard"}
    return tokens(plan, SINKS_FAMILIES)


def flex(plan: Plan) -> dict:
    deadline = time.monotonic() + 0.8 * LIMIT_S * (1 if plan.device.startswith("cuda") else 4)
    out = {"tokens": tokens(plan)}
    out["decode"] = decode(plan, deadline)
    out["sinks"] = sinks(plan, deadline)
    checked = [*out["tokens"].values(), *([] if "skipped" in out["sinks"] else out["sinks"].values())]
    out["ok"] = all(t["prompts_equal"] == t["num_prompts"] for t in checked)
    return out
