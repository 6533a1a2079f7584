"""Speculative decoding (issue 34): proposers guess the next k tokens of a sequence, the target
model checks them all in one forward, and `rejection.py` keeps the longest run the target agrees
with, so the output is the target's (greedy: identical; sampled: the same distribution).

    proposer = create_proposer(SpeculativeConfig("ngram", 3), target_runner)
    drafts = proposer.propose([SpecSequence(rid, token_ids, k), ...])   # per sequence, up to k ids

The scheduler asks a `Speculator` (speculator.py) which decoding sequences speculate this step and
for their drafts; the runner verifies them (verify.py). docs/speculative.md.
"""
from __future__ import annotations

# only what imports nothing of the engine: engine.config imports this package (SpeculativeConfig);
# create_proposer imports the proposers' modules, which register themselves
from engine.speculative.base import PROPOSERS, Proposer, SpecSequence, create_proposer

__all__ = ["PROPOSERS", "Proposer", "SpecSequence", "create_proposer"]
