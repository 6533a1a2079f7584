"""The rejection sampler (engine/speculative/rejection.py): greedy keeps exactly the target's
argmax run; sampling reproduces the target's distribution whatever the proposer's."""
from __future__ import annotations

import torch

from engine.speculative.rejection import rejection_sample


def test_greedy_keeps_the_drafts_up_to_the_first_that_is_not_the_argmax():
    probs = torch.tensor([[[0.1, 0.9, 0.0], [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]],
                          [[0.1, 0.9, 0.0], [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]]])
    drafts = torch.tensor([[1, 0], [1, 2]])
    assert rejection_sample(probs, drafts, greedy=True) == [[1, 0, 2], [1, 0]]


def _first_token_frequencies(p, q, draft_probs, trials, seed):
    """How often each token comes out first, over `trials` sequences with one draft each, the draft
    drawn from q (the proposer's distribution)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q.expand(trials, -1), 1, replacement=True, generator=g)  # (trials, 1)
    target = torch.stack([p, p]).expand(trials, -1, -1)  # (trials, 2, V)
    outs = rejection_sample(target, drafts, None if draft_probs is None else draft_probs.expand(trials, 1, -1),
                            generator=g)
    first = torch.tensor([o[0] for o in outs])
    return torch.bincount(first, minlength=p.numel()).float() / trials


def test_sampling_reproduces_the_target_distribution():
    """Over 40,000 one-draft sequences on a 5-token vocabulary, with the proposer's own distribution
    (unlike the target's) and with point-mass drafts (the n-gram's), each token's frequency is the
    target's probability within 0.01 (4-5 standard errors of a frequency near 0.3 at this count);
    a sampler that accepted every draft would give q instead, 0.1 to 0.3 away."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.3])
    for draft_probs in (q[None], None):
        freq = _first_token_frequencies(p, q, draft_probs, 40_000, seed=0)
        assert (freq - p).abs().max() < 0.01, (draft_probs is None, freq)
    assert (q - p).abs().max() > 0.1  # the control: the proposer's distribution is far from the target's
