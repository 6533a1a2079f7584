"""fp8 KV cache against the model-dtype cache on SmolLM2: bytes, quality, decode speed.

    python -m bench.kv_dtype                       # all three, model dtype auto, 2 threads
    python -m bench.kv_dtype --json                # one JSON object on stdout; logs go to stderr
    python -m bench.kv_dtype --skip-speed --dtype float32

- bytes: KV bytes per token (all layers, K and V) in fp32, bf16 and fp8.
- quality: greedy continuations (32 tokens, EOS ignored) of 20 chat prompts with fp8 KV against
  the same engine with `auto` KV: how many are identical, the mean length of the common prefix,
  and the share of positions that agree; perplexity of a fixed paragraph, teacher-forced through
  the paged cache in 64-token chunks (so every chunk reads its context from the cache).
- speed: ms per decode step at batch 1 and 32 (prompts of 256 random tokens, the median of 24
  steps once every request decodes), each KV dtype, the two engines stepping in turn.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time

import torch

from decode_worker.llm import LLM
from engine.core.request import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from engine.core.kv_cache import kv_block_bytes
from engine.loading.loader import load_model_config, resolve_model_path

logger = logging.getLogger("bench.kv_dtype")
KV_DTYPES = ("auto", "fp8_e4m3")
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis to a child in two sentences.",
    "Write a haiku about the ocean.", "Give me three tips for learning a new language.",
    "What does a compiler do?", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?", "Write a short poem about autumn leaves.", "What is a prime number?",
    "Describe how a bicycle works.", "What are the benefits of regular exercise?",
    "Explain what an API is to a beginner.", "Suggest a name for a friendly robot.",
    "How do I make a cup of tea?", "What causes earthquakes?", "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?", "Write a limerick about a cat.",
    "How does a refrigerator keep food cold?",
]
PARAGRAPH = (
    "The river rose slowly through the night, and by morning the low fields on the eastern bank were under "
    "water. Farmers who had lived there for generations knew the signs: the geese left early, the wind turned "
    "to the south, and the rain came in long grey curtains from the hills. They moved their animals to the "
    "higher pastures, stacked sandbags against the doors of the barns and carried what they could into the "
    "upper rooms of their houses. In the village, the baker kept his ovens going, because people would need "
    "bread whatever happened, and the schoolteacher opened the hall so that families from the flooded farms "
    "had somewhere dry to sleep. By the third day the water began to fall. It left behind a layer of fine "
    "brown silt, broken fences and a smell of mud that lingered for weeks. Yet the next spring the fields were "
    "greener than anyone could remember, and the old farmers said, as their parents had said before them, "
    "that the river takes with one hand and gives with the other. Children who had watched the flood from the "
    "hall windows grew up to tell the story to their own children, adding a little more each time, until the "
    "water in the tale reached the church steps and the baker had saved the whole village with a single loaf."
)


def kv_bytes_per_token(model: str) -> dict[str, int]:
    mc = load_model_config(resolve_model_path(model))
    return {name: kv_block_bytes(mc, mc.num_kv_heads, 1, dtype) for name, dtype in
            (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn))}


def _llm(model: str, dtype: str, kv_cache_dtype: str, num_blocks: int) -> LLM:
    return LLM(model=model, dtype=dtype, device="cpu", num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)


@torch.inference_mode()
def perplexity(llm: LLM, text: str, chunk: int = 64) -> tuple[float, int]:
    """exp(mean NLL) of `text`'s tokens after the first, fed in `chunk`-token steps through the
    paged cache (blocks 1.. of the runner's pool, written directly: the engine must be idle)."""
    runner, ids, rid = llm.engine.runner, llm.encode(text), "ppl"
    blocks = runner.scratch_tables(len(ids))
    nll = 0.0
    try:
        for start in range(0, len(ids), chunk):
            toks = ids[start:start + chunk]
            new = [NewRequestData(rid, toks, 0, blocks, SamplingParams(), True)] if start == 0 else []
            cached = [] if start == 0 else [CachedRequestData(rid, toks, start, (), True)]
            sched = SchedulerOutput(new_requests=new, cached_requests=cached)
            runner.update_states(sched)
            inp = runner.prepare_inputs(sched)
            hidden = runner.hidden_states(inp)
            logp = runner.model.compute_logits(hidden).float().log_softmax(-1)  # (len(toks), vocab)
            targets = ids[start + 1:start + 1 + len(toks)]
            nll -= logp[torch.arange(len(targets)), torch.tensor(targets)].sum().item()
    finally:
        runner.update_states(SchedulerOutput(finished_req_ids=[rid]))
        llm.engine.kv.reset_prefix_cache()
    return math.exp(nll / (len(ids) - 1)), len(ids)


def quality(model: str, dtype: str, max_tokens: int = 32) -> dict:
    """Greedy agreement (fp8 against auto KV) and perplexity; the top-2 logprob gap of the auto run
    where the two first differ says whether they part at near-ties."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs, ppl = {}, {}
    for kv in KV_DTYPES:
        llm = _llm(model, dtype, kv, num_blocks=256)
        outs[kv] = llm.generate(QUESTIONS, params, chat=True)
        ppl[kv], num_tokens = perplexity(llm, PARAGRAPH)
    pairs = [(a.token_ids, b.token_ids) for a, b in zip(outs["auto"], outs["fp8_e4m3"])]
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    gaps = [_top2_gap(o.logprobs[p]) for o, p in zip(outs["auto"], prefixes) if p < max_tokens]
    every_gap = [_top2_gap(lp) for o in outs["auto"] for lp in o.logprobs]
    return {"prompts": len(QUESTIONS), "tokens_per_prompt": max_tokens,
            "identical": sum(p == max_tokens for p in prefixes), "mean_common_prefix": statistics.mean(prefixes),
            "position_agreement": sum(x == y for a, b in pairs for x, y in zip(a, b)) / (len(pairs) * max_tokens),
            "top2_gap_at_divergence_median": statistics.median(gaps) if gaps else None,
            "top2_gap_median_all_positions": statistics.median(every_gap),
            "perplexity": {kv: round(v, 3) for kv, v in ppl.items()}, "perplexity_tokens": num_tokens}


def _top2_gap(logprobs: dict[int, float]) -> float:
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1]


def decode_ms(model: str, dtype: str, batch: int, prompt_len: int = 256, steps: int = 24) -> dict[str, float]:
    """Median ms of a decode step with `batch` requests of `prompt_len` random tokens, all decoding,
    per KV dtype. The engines step in turn, so that a busy machine slows both alike."""
    engines, g = {}, torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=g).tolist()
    for kv in KV_DTYPES:
        engine = engines[kv] = _llm(model, dtype, kv, num_blocks=batch * (prompt_len + steps + 8) // 16 + 8).engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
        while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
            engine.step()  # the prefills
    times = {kv: [] for kv in KV_DTYPES}
    for _ in range(steps):
        for kv, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[kv].append(time.perf_counter() - start)
    return {kv: round(1000 * statistics.median(t), 2) for kv, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(args.threads)
    out = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
           "kv_bytes_per_token": kv_bytes_per_token(args.model)}
    if not args.skip_quality:
        out["quality"] = quality(args.model, args.dtype)
    if not args.skip_speed:
        out["decode_ms_per_step"] = {f"batch {b}": decode_ms(args.model, args.dtype, b) for b in (1, 32)}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
