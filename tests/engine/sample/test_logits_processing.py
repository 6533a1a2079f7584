"""The sampling controls against their written formulas (OpenAI's API reference for the
penalties and logit_bias, vLLM's SamplingParams documentation for repetition_penalty, min_p and
min_tokens), on hand-made logits; the expected values are worked out here, token by token."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.request import Request, SamplingParams, TokenHistory
from engine.sample.sampling import Sampler, history_of, process_logits

GREEDY = dict(temperature=0.0, max_tokens=8)


def processed(logits: list[float], params: SamplingParams, history: TokenHistory) -> list[float]:
    """One row's logits after its logit_bias, min_tokens and penalties."""
    return process_logits(torch.tensor([logits]), [params], [history])[0].tolist()


def test_frequency_and_presence_follow_openais_formula():
    """mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, c counted in the output only."""
    logits = [1.0, 2.0, 3.0, 0.5]
    hist = TokenHistory(prompt=[3, 3, 3], output=[1, 1, 2])
    got = processed(logits, SamplingParams(**GREEDY, frequency_penalty=0.5, presence_penalty=0.25), hist)
    want = [1.0, 2.0 - 2 * 0.5 - 0.25, 3.0 - 1 * 0.5 - 0.25, 0.5]  # token 3 only in the prompt: untouched
    assert got == pytest.approx(want)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = [2.0, -1.0, 3.0, 0.5]
    hist = TokenHistory(prompt=[0], output=[1])
    got = processed(logits, SamplingParams(**GREEDY, repetition_penalty=2.0), hist)
    assert got == pytest.approx([1.0, -2.0, 3.0, 0.5])


def test_logit_bias_adds_and_min_tokens_holds_the_stop_set_back():
    logits = [1.0, 2.0, 3.0, 0.5]
    p = SamplingParams(**GREEDY, logit_bias={3: 10.0, 0: -1.0}, min_tokens=2, stop_token_ids=(1,))
    got = processed(logits, p, TokenHistory(output=[0], stop_ids=frozenset({2, 1})))
    assert got == [0.0, -math.inf, -math.inf, 10.5]
    assert processed(logits, p, TokenHistory(output=[0, 0], stop_ids=frozenset({2, 1}))) == [0.0, 2.0, 3.0, 10.5]


def test_a_retry_counts_the_output_its_prompt_carries():
    """A retried request's prompt ends with its earlier output (num_resumed_tokens = 2, min_tokens
    already lowered by those 2 by the router): the penalties count them as output, min_tokens only
    counts this attempt's tokens."""
    sp = SamplingParams(**GREEDY, frequency_penalty=1.0, min_tokens=1, num_resumed_tokens=2)
    req = Request("r#1", [3, 1, 1], sp, eos_token_ids=frozenset({2}))
    hist = history_of(req)
    assert hist.prompt == frozenset({3}) and hist.output == [1, 1] and hist.num_resumed == 2
    assert processed([1.0, 2.0, 3.0, 0.5], sp, hist) == [1.0, 0.0, -math.inf, 0.5]
    hist.output.append(0)
    assert processed([1.0, 2.0, 3.0, 0.5], sp, hist) == [0.0, 0.0, 3.0, 0.5]


def test_min_p_keeps_tokens_within_its_fraction_of_the_likeliest():
    """p = softmax([ln 8, ln 4, ln 2, ln 1]) = [8, 4, 2, 1] / 15: min_p 0.3 keeps p >= 0.3 * 8/15, so
    tokens 0 and 1; seeded draws then never give 2 or 3, and give both 0 and 1."""
    logits = torch.log(torch.tensor([[8.0, 4.0, 2.0, 1.0]])).repeat(200, 1)
    params = [SamplingParams(max_tokens=4, temperature=1.0, min_p=0.3, seed=s) for s in range(200)]
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    drawn = set(Sampler()(logits, params, gens).token_ids)
    assert drawn == {0, 1}


def test_logprobs_are_the_models_own_and_greedy_follows_the_bias():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler()(logits, [SamplingParams(**GREEDY, logit_bias={0: 5.0}, logprobs=0)], [None], [None])
    assert out.token_ids == [0]
    assert out.extras[0]["logprobs"][0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
