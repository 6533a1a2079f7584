"""Measure one instance's performance profile for the autoscaler (`pdserve bench --profile`).

Runs the engine in this process on the spec's model, dtype and cache settings:
  prefill   batches of prompts with max_tokens=1          -> prompt tokens per second
  decode    b short prompts decoding together, b in BATCHES -> seconds per step; a least-squares
            line itl(b) = base + per_seq * b through the points
  startup   seconds to build the engine (load weights, allocate KV): a lower bound on an instance's start
The same figures are also measured online from the instances' counters (see OnlineProfile).
"""
from __future__ import annotations

import logging
import random
import time

from cluster.autoscale.autoscaler import Profile
from cluster.autoscale.forecast import fit_line
from cluster.spec import ClusterSpec

logger = logging.getLogger(__name__)
BATCHES = (1, 4, 16, 32)


def measure_profile(spec: ClusterSpec, prompt_tokens: int = 512, num_prompts: int = 4,
                    decode_tokens: int = 16) -> tuple[Profile, dict]:
    """Returns the profile and the raw points it was fitted from."""
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams

    start = time.monotonic()
    engine = ColocatedEngine(spec.engine_config("decode"))
    startup_s = time.monotonic() - start
    llm = LLM(engine=engine)
    rng = random.Random(0)
    vocab = engine.runner.model_config.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]

    llm.generate(prompts(1, 32), SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = time.monotonic()
    llm.generate(prompts(num_prompts, prompt_tokens), SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_tps = num_prompts * prompt_tokens / (time.monotonic() - start)
    points = []
    for b in BATCHES:
        if b > spec.max_num_seqs:
            break
        outs = llm.generate(prompts(b, 16), SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
        step_s = max(o.finished_s for o in outs) - max(o.first_token_s for o in outs)
        points.append((b, step_s / (decode_tokens - 1)))
        logger.info("decode batch %d: %.1f ms/step", b, points[-1][1] * 1000)
    base, per_seq = fit_line(points)
    profile = Profile(prefill_tokens_per_s=prefill_tps, decode_itl_base_s=base, decode_itl_per_seq_s=per_seq,
                      max_num_seqs=spec.max_num_seqs,
                      kv_capacity_tokens=(engine.runner.num_blocks - 1) * engine.runner.block_size,
                      startup_s=startup_s)
    return profile, {"decode_points": points, "prompt_tokens": prompt_tokens, "model": spec.model,
                     "dtype": str(engine.runner.dtype).replace("torch.", "")}
