"""How much int8 linear layers change SmolLM2: greedy agreement and perplexity against unquantized.

    python -m bench.quant_quality                      # fp32, 20 chat prompts x 32 greedy tokens
    python -m bench.quant_quality --dtype bfloat16 --json

Both engines load the same GGUF; `--quantization` names the method under test (int8). Greedy
agreement: per prompt, the tokens generated before the first difference (EOS ignored), and
teacher-forced top-1 agreement (the int8 model's argmax on the unquantized model's continuation).
Perplexity: of a few plain-English paragraphs, and of the unquantized model's own continuations.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import torch

from engine.core.request import NewRequestData, SamplingParams, SchedulerOutput

CHATS = [
    "What is the capital of France?", "Explain photosynthesis to a child in two sentences.",
    "Write a haiku about the ocean.", "Give me three tips for learning a new language.",
    "What does a compiler do?", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?", "What is the difference between a virus and a bacterium?",
    "Write a short poem about autumn leaves.", "What are the planets of the solar system?",
    "How does a bicycle stay upright?", "Translate 'good morning' into Spanish and German.",
    "What is machine learning, in one paragraph?", "Suggest a name for a friendly robot.",
    "Why do cats purr?", "List three healthy breakfast ideas.", "What causes the seasons on Earth?",
    "Describe a rainy day in a city.", "How do vaccines work?",
]
# Plain text for perplexity, written for this benchmark (no external data set on this machine).
PARAGRAPHS = [
    "The river ran slowly through the valley, past the old mill and the stone bridge. In the summer, children "
    "swam in the shallow pools near the bank, while their parents sat in the shade of the willow trees and "
    "talked about the harvest.",
    "A computer program is a sequence of instructions that a machine can follow. Programmers write these "
    "instructions in a programming language, and a compiler or an interpreter turns them into operations "
    "that the processor can execute.",
    "Bread is made from flour, water, salt and yeast. The yeast feeds on the sugars in the dough and releases "
    "carbon dioxide, which makes the dough rise. Baking then sets the structure and browns the crust.",
    "The city council met on Tuesday evening to discuss the new bus routes. Several residents asked for more "
    "frequent service in the early morning, when many people travel to work at the hospital and the factory.",
    "Mountains form over millions of years as the plates of the Earth's crust push against each other. Wind, "
    "rain and ice slowly wear them down again, carrying sand and stones into the rivers and the sea.",
]


def sequence_logits(runner, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of `token_ids` (one prefill into blocks 1..n of the runner's cache;
    the caller resets the engine's prefix cache afterwards). Returns (len, vocab) float32."""
    rid = "quality-probe"
    blocks = runner.scratch_tables(len(token_ids))
    sched = SchedulerOutput(new_requests=[NewRequestData(rid, token_ids, 0, blocks, SamplingParams(), True)])
    try:
        runner.update_states(sched)
        inp = runner.prepare_inputs(sched)
        with torch.inference_mode():
            hidden = runner.hidden_states(inp)
            return runner.model.compute_logits(hidden).float()
    finally:
        runner.update_states(SchedulerOutput(finished_req_ids=[rid]))


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed negative log-likelihood of `targets` under `logits` (len(targets), vocab)."""
    return -torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None]).sum().item()


def _perplexities(llm, texts: list[list[int]], continuations: list[tuple[list[int], list[int]]]):
    runner = llm.engine.runner
    try:
        text_nll = sum(_nll(sequence_logits(runner, t)[:-1], t[1:]) for t in texts)
        cont_logits = [sequence_logits(runner, p + c)[len(p) - 1:-1] for p, c in continuations]
    finally:
        llm.engine.kv.reset_prefix_cache()  # the probe wrote blocks the engine may have cached
    cont_nll = sum(_nll(lg, c) for lg, (_, c) in zip(cont_logits, continuations))
    text_tokens = sum(len(t) - 1 for t in texts)
    cont_tokens = sum(len(c) for _, c in continuations)
    return math.exp(text_nll / text_tokens), math.exp(cont_nll / cont_tokens), cont_logits


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(dtype: str, quantization: str, num_prompts: int, max_tokens: int, threads: int) -> dict:
    from decode_worker.llm import LLM
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = {}
    for q in ("none", quantization):
        llm = LLM(model="smollm2", dtype=dtype, num_blocks=128, device="cpu", quantization=q, num_threads=threads)
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS[:num_prompts]]
        runs[q] = (llm, prompts, [o.token_ids for o in llm.generate(prompts, params)])
    base_llm, prompts, base_out = runs["none"]
    q_llm, _, q_out = runs[quantization]
    texts = [base_llm.tokenizer.encode(p) for p in PARAGRAPHS]
    continuations = list(zip(prompts, base_out))
    base_text_ppl, base_cont_ppl, base_logits = _perplexities(base_llm, texts, continuations)
    q_text_ppl, q_cont_ppl, q_logits = _perplexities(q_llm, texts, continuations)
    prefix = [_first_difference(a, b) for a, b in zip(base_out, q_out)]
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(base_logits, q_logits)]).float().mean().item()
    return {"dtype": dtype, "quantization": quantization, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "prompts_identical": sum(p == max_tokens for p in prefix), "agreed_prefix_tokens": prefix,
            "mean_agreed_prefix": sum(prefix) / len(prefix), "teacher_forced_top1_agreement": top1,
            "text_ppl": {"none": base_text_ppl, quantization: q_text_ppl}, "text_ppl_ratio": q_text_ppl / base_text_ppl,
            "continuation_ppl": {"none": base_cont_ppl, quantization: q_cont_ppl},
            "continuation_ppl_ratio": q_cont_ppl / base_cont_ppl}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default="int8", choices=["int8", "w8a8", "int4"])
    p.add_argument("--num-prompts", type=int, default=20, choices=range(1, len(CHATS) + 1), metavar="N")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    r = compare(args.dtype, args.quantization, args.num_prompts, args.max_tokens, args.threads)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['quantization']} vs unquantized, SmolLM2 {r['dtype']}: {r['prompts_identical']}/{r['num_prompts']} "
              f"prompts identical for {r['max_tokens']} greedy tokens, mean agreed prefix "
              f"{r['mean_agreed_prefix']:.1f} tokens, teacher-forced top-1 {r['teacher_forced_top1_agreement']:.3f}; "
              f"perplexity text {r['text_ppl']['none']:.2f} -> {r['text_ppl'][r['quantization']]:.2f} "
              f"(x{r['text_ppl_ratio']:.3f}), continuations {r['continuation_ppl']['none']:.3f} -> "
              f"{r['continuation_ppl'][r['quantization']]:.3f} (x{r['continuation_ppl_ratio']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
