"""Speculative decoding (issue 34): proposers guess the next k tokens of a sequence, the target
model checks them all in one forward, and `rejection.py` keeps the longest run the target agrees
with, so the output is the target's (greedy: identical; sampled: the same distribution).

    proposer = create_proposer(SpeculativeConfig("ngram", 3), target_runner)
    drafts = proposer.propose([SpecSequence(rid, token_ids, k), ...])   # per sequence, up to k ids

The scheduler asks a `Speculator` (speculator.py) which decoding sequences speculate this step and
for their drafts. The runner (engine/runner/model_runner.py), a floor above, calls this package
through the names below only: it loads what runs beside it (`load_proposer_model`), profiles
verification (`measure_verify`) and verifies each step's drafts (`split_rows`, `verify`).
Proposers see the runner as `base.TargetRunner`; the methods' registry is registry.py.
docs/speculative.md.
"""
from __future__ import annotations

from engine.speculative.base import Proposer, SpecSequence, TargetRunner
from engine.speculative.profile import measure_verify
from engine.speculative.registry import PROPOSERS, create_proposer, load_proposer_model, proposer_class
from engine.speculative.verify import split_rows, verify

__all__ = ["PROPOSERS", "Proposer", "SpecSequence", "TargetRunner", "create_proposer", "load_proposer_model",
           "measure_verify", "proposer_class", "split_rows", "verify"]
