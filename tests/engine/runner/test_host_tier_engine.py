"""A host tier under a colocated engine's pool (engine/core/host_tier.py, engine/runner/host_arena.py):
a conversation's blocks evicted by other prompts spill to host memory and come back for its next
turn, and the next turn's greedy tokens and top logprobs equal, bit for bit (the batch-invariant
mode), a run that never spilled (a pool that holds everything) and one without any cache."""
from __future__ import annotations

import pytest

from tests.helpers import generate_steps, make_hf_tiny_llama, random_prompts, tiny_engine

pytestmark = pytest.mark.timeout(300)
TURN1 = random_prompts(1, [64], seed=41)[0]  # 4 blocks of 16
OTHERS = random_prompts(3, [64], seed=42)  # each evicts what the small pool held
MAX_TOKENS = 6


def conversation(engine) -> tuple[list, int]:
    """Turn 1, three other prompts, then turn 2 (turn 1, its reply, a new message): turn 2's
    (tokens, logprobs) and how many of its prompt tokens were not computed."""
    (first, _, _), = generate_steps(engine, [TURN1], MAX_TOKENS)
    for other in OTHERS:
        generate_steps(engine, [other], MAX_TOKENS)
    (tokens, logprobs, cached), = generate_steps(engine, [TURN1 + first + [5] * 10], MAX_TOKENS)
    engine.kv.assert_no_leaks()
    return (tokens, logprobs), cached


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_tiny_llama(seed=3)


def engine_of(hf_model, **knobs):
    return tiny_engine(hf_model, **{"num_blocks": 8, "block_size": 16, "batch_invariant": True,
                                    "attention_backend": "torch", **knobs})


@pytest.mark.parametrize("gib", [1e-3, 4e-5])  # room for every evicted block; for a few (the oldest dropped)
def test_the_next_turn_comes_back_from_host_memory_and_equals_a_run_that_never_spilled(hf_model, gib):
    roomy, _ = conversation(engine_of(hf_model, num_blocks=64))
    uncached, none = conversation(engine_of(hf_model, prefix_caching=False))
    engine = engine_of(hf_model, host_tier_gib=gib)
    got, cached = conversation(engine)
    assert got == roomy == uncached and none == 0
    tier, arena = engine.kv.tier, engine.runner.host_arena
    if arena.num_slots >= 16:
        assert cached == 64 and tier.stats["reloaded_blocks"] == 4 and tier.stats["dropped_blocks"] == 0
    else:  # the oldest blocks, turn 1's, were dropped: recomputed
        assert tier.stats["dropped_blocks"] > 0 and tier.num_blocks == arena.num_slots


def test_without_a_tier_the_next_turn_is_computed_again(hf_model):
    engine = engine_of(hf_model)
    _, cached = conversation(engine)
    assert engine.kv.tier is None and engine.runner.host_arena is None and cached == 0
