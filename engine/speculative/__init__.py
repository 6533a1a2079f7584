"""Speculative decoding (issue 34): proposers guess the next k tokens of a sequence, the target
model checks them all in one forward, and `rejection.py` keeps the longest run the target agrees
with, so the output is the target's (greedy: identical; sampled: the same distribution).

    proposer = create_proposer("ngram", max_n=4)
    drafts = proposer.propose([history_a, history_b], k=3)     # per sequence, up to k token ids

Built so far: the proposer interface and registry, the n-gram (prompt lookup) proposer, and the
rejection sampler. Not wired into the engine yet: see docs/speculative.md.
"""
from __future__ import annotations

from engine.speculative.base import PROPOSERS, Proposer, create_proposer
from engine.speculative.ngram import NgramProposer

__all__ = ["PROPOSERS", "NgramProposer", "Proposer", "create_proposer"]
