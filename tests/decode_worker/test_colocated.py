"""Continuous batching, prefix caching and preemption of the colocated engine (tiny model, fp32)."""
from __future__ import annotations

import pytest

from decode_worker.llm import LLM
from engine.core.request import SamplingParams
from tests.helpers import hf_greedy, make_hf_tiny_llama, random_prompts, tiny_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_tiny_llama(seed=7)


def _generate(hf_model, prompts, params, **knobs):
    llm = LLM(engine=tiny_engine(hf_model, **knobs))
    outs = llm.generate(prompts, params)
    llm.engine.kv.assert_no_leaks()
    return outs, llm.engine


def test_greedy_matches_transformers(hf_model):
    """32 greedy tokens equal transformers' generate for 5 prompts."""
    prompts = random_prompts(5, [5, 17, 33, 64, 3], seed=1)
    outs, _ = _generate(hf_model, prompts, SamplingParams(max_tokens=32, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf_model, p, 32)
        assert o.finish_reason == "length"


def test_continuous_batching_equals_alone(hf_model):
    """64 requests of mixed prompt and output lengths, batched and chunked, each get exactly the
    tokens they get when run alone."""
    prompts = random_prompts(64, [3, 150, 40, 9, 77, 1, 260, 25], seed=2)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in [1, 7, 30, 12, 50, 3, 20, 9] * 8]
    batched, engine = _generate(hf_model, prompts, params, max_num_batched_tokens=128, num_blocks=600)
    for i in range(0, 64, 9):  # run-alone references for a spread of them
        alone, _ = _generate(hf_model, [prompts[i]], params[i], prefix_caching=False)
        assert batched[i].token_ids == alone[0].token_ids, i
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(batched, params))


def test_prefix_caching_skips_cached_tokens(hf_model):
    """A request sharing a 200-token prefix with an earlier one computes only its new tokens,
    and gives the same output as without the cache."""
    shared = random_prompts(1, [200], seed=3)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(engine=tiny_engine(hf_model))
    llm.generate([first], sp)
    computed = []
    step = llm.engine.runner.execute
    llm.engine.runner.execute = lambda s: computed.append(s.total_num_scheduled_tokens) or step(s)
    out = llm.generate([second], sp)[0]
    assert out.num_cached_tokens == 192  # 12 full blocks of 16
    assert computed[0] == len(second) - 192
    no_cache, _ = _generate(hf_model, [second], sp, prefix_caching=False)
    assert out.token_ids == no_cache[0].token_ids
    llm.engine.kv.assert_no_leaks()


def test_preemption_recomputes_correctly(hf_model):
    """With a KV pool too small for all requests at once, requests are preempted and recomputed,
    and every one still gets its run-alone tokens."""
    prompts = random_prompts(12, [30, 50, 20], seed=4)
    sp = SamplingParams(max_tokens=40, **GREEDY)
    outs, engine = _generate(hf_model, prompts, sp, num_blocks=20)
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts[:4], outs[:4]):
        alone, _ = _generate(hf_model, [p], sp)
        assert o.token_ids == alone[0].token_ids


def test_stop_token_ids_and_eos(hf_model):
    """A stop token id ends the request with it as the last token; EOS does unless ignored."""
    prompt = random_prompts(1, [10], seed=5)[0]
    ref = hf_greedy(hf_model, prompt, 20)
    stop_at = ref[5]
    outs, _ = _generate(hf_model, [prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_at,)))
    assert outs[0].token_ids == ref[:ref.index(stop_at) + 1]
    assert outs[0].finish_reason == "stop"


def test_abort_frees_blocks(hf_model):
    """An aborted request leaves no blocks behind and the others finish."""
    engine = tiny_engine(hf_model)
    prompts = random_prompts(3, [40], seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, **GREEDY))
    engine.step()
    engine.abort_request("r1")
    done = set()
    while engine.has_unfinished():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"r0", "r2"}
    engine.kv.assert_no_leaks()


def test_seeded_sampling_reproducible(hf_model):
    """The same seed gives the same tokens, alone or batched with other requests."""
    prompt = random_prompts(1, [12], seed=8)[0]
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone, _ = _generate(hf_model, [prompt], sp)
    others = random_prompts(4, [20], seed=9)
    batched, _ = _generate(hf_model, others + [prompt], [SamplingParams(max_tokens=16, temperature=1.0)] * 4 + [sp])
    assert alone[0].token_ids == batched[-1].token_ids


def test_n_choices_fork_after_one_prefill(hf_model):
    """n = 3 prefills the prompt once and forks: greedy choices each equal transformers' greedy
    tokens (the partial last prompt block copied right, prompt 21 tokens over blocks of 16); seeded
    ones differ from each other and come back the same on a second run, batched with others."""
    prompt = random_prompts(1, [21], seed=10)[0]
    outs, engine = _generate(hf_model, [prompt], SamplingParams(max_tokens=24, n=3, **GREEDY))
    ref = hf_greedy(hf_model, prompt, 24)
    assert [o.request_id for o in outs] == ["gen-0/0", "gen-0/1", "gen-0/2"]
    assert all(o.token_ids == ref for o in outs)
    assert engine.scheduler.requests == {} and engine.scheduler.num_preemptions == 0
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=99, n=3, ignore_eos=True)
    first, _ = _generate(hf_model, [prompt], sp)
    again, _ = _generate(hf_model, random_prompts(2, [30], seed=11) + [prompt],
                         [SamplingParams(max_tokens=8, temperature=1.0)] * 2 + [sp])
    assert [o.token_ids for o in first] == [o.token_ids for o in again[2:]]
    assert len({tuple(o.token_ids) for o in first}) == 3
