"""What a JSON-schema grammar on every request costs a decode step: the colocated engine stepping N
running requests with and without `structured_output`, in the same run.

    python -m bench.grammar_mask                 # SmolLM2, the engine's defaults, batches 1 and 32
    python -m bench.grammar_mask --json
    python -m bench.grammar_mask --batches 1,8,32 --steps 40 --rounds 5

For each batch size, rounds alternate plain and grammar (plain, grammar, plain, ...) so that machine
drift hits both alike. A round adds N chat requests asking for a long JSON list (seeded sampling at
temperature 0.8, EOS ignored, so every request runs through the timed steps), prefills and steps them
3 times unmeasured, times `--steps` decode steps (ms per step, wall clock), then aborts them. The
result is the median over rounds. `mask_ms_per_step` is the part spent filling and applying the
bitmasks (engine/sample/structured_output.py `apply_grammar_masks`); `grammar_live` is the share of timed
(request, step) pairs whose grammar had not yet ended (after the end only EOS is allowed, which is cheap).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import engine.sample.structured_output
from decode_worker.llm import LLM
from engine.attention import BACKENDS
from engine.core.request import SamplingParams

SCHEMA = {"type": "object", "required": ["products"], "properties": {"products": {
    "type": "array", "items": {"type": "object", "required": ["name", "price", "tags"], "properties": {
        "name": {"type": "string"}, "price": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "gift"]}}}}}}}
PROMPT = "List 50 products of a hardware store as JSON, with their prices and tags. Request {i}."


@contextlib.contextmanager
def _timed_masks(totals: list[float]):
    """Adds the time spent in the sampler's `apply_grammar_masks` calls to totals[0]."""
    apply = engine.sample.structured_output.apply_grammar_masks

    def timed(logits, grammars):
        start = time.perf_counter()
        apply(logits, grammars)
        totals[0] += time.perf_counter() - start

    engine.sample.structured_output.apply_grammar_masks = timed
    try:
        yield
    finally:
        engine.sample.structured_output.apply_grammar_masks = apply


def one_round(llm: LLM, n: int, steps: int, grammar: bool, tag: str) -> tuple[float, float, float]:
    """(ms per decode step, mask ms per step, share of live grammars) for n requests."""
    eng, runner = llm.engine, llm.engine.runner
    so = ("json_schema", json.dumps(SCHEMA)) if grammar else None
    ids = [f"{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        params = SamplingParams(max_tokens=steps + 8, temperature=0.8, seed=i, ignore_eos=True, structured_output=so)
        eng.add_request(rid, llm.encode(PROMPT.format(i=i), chat=True), params)
    for _ in range(3):  # prefill, then two warm decode steps
        eng.step()
    mask, live = [0.0], 0
    with _timed_masks(mask):
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
            if grammar:
                live += sum(not runner.requests[rid].grammar.is_finished for rid in ids if rid in runner.requests)
        elapsed = time.perf_counter() - start
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    return elapsed / steps * 1e3, mask[0] / steps * 1e3, live / (n * steps) if grammar else 0.0


def measure(llm: LLM, batches: list[int], steps: int, rounds: int) -> dict:
    out = {"ms_per_step": {}, "mask_ms_per_step": {}, "grammar_live": {}}
    for n in batches:
        runs = {False: [], True: []}
        for r in range(rounds):
            for grammar in (False, True):
                runs[grammar].append(one_round(llm, n, steps, grammar, f"b{n}-r{r}-{'g' if grammar else 'p'}"))
        out["ms_per_step"][n] = {"plain": statistics.median(x[0] for x in runs[False]),
                                 "json_schema": statistics.median(x[0] for x in runs[True])}
        out["mask_ms_per_step"][n] = statistics.median(x[1] for x in runs[True])
        out["grammar_live"][n] = statistics.mean(x[2] for x in runs[True])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_mask", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration, interleaved")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or args.rounds < 1 or any(b < 1 for b in batches):
        p.error("--steps, --rounds and every batch size must be >= 1")
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, attention_backend=args.attention_backend,
              device=args.device, max_num_seqs=max(batches))
    result = measure(llm, batches, args.steps, args.rounds)
    runner = llm.engine.runner
    result.update(config={"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
                          "attention": runner.backend.name}, threads=args.threads, steps=args.steps,
                  rounds=args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {result['config']['device']}, {result['config']['dtype']}, {args.threads} threads")
        for n in batches:
            ms = result["ms_per_step"][n]
            print(f"  batch {n:>3}: plain {ms['plain']:7.2f} ms/step, json_schema {ms['json_schema']:7.2f} ms/step "
                  f"(masks {result['mask_ms_per_step'][n]:.2f} ms, grammar live {result['grammar_live'][n]:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
