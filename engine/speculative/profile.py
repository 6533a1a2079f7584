"""Where speculation pays: a decode step's and a verify step's seconds per batch size, measured at
load, and the proposer's.

A verify step computes k + 1 tokens per sequence where a decode step computes 1. It pays at batch
size B when the tokens it yields per sequence, 1 + (drafts accepted per step, measured while
serving), times a decode step's time exceed the verify step's time plus the proposer's:

    (1 + accepted) * decode_s(B) > verify_s(B) + propose_s(B)

At small batches a step is bound by reading the weights, and k + 1 tokens cost little more than 1;
at large ones it is bound by compute and speculation costs what it saves.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.timing import best_seconds
from engine.speculative.base import PROFILE_CONTEXT

if TYPE_CHECKING:
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)

PROFILE_MAX_BATCH = 64  # larger batches are taken to behave as the largest measured
EVERY_BATCH = 1 << 30  # max_batch_size where speculation pays at the largest measured batch


@dataclass(frozen=True)
class SpecProfile:
    batch_sizes: tuple[int, ...]
    decode_s: tuple[float, ...]  # one token per sequence
    verify_s: tuple[float, ...]  # k + 1 tokens per sequence, every position sampled and verified
    propose_s: tuple[float, ...] = ()  # the proposer's, per batch size (empty: not measured, taken as 0)

    def max_batch_size(self, accepted_per_step: float) -> int:
        """The largest measured batch size where speculation pays, at `accepted_per_step` drafts
        accepted per sequence and step; 0 where it pays at none (a batch past the largest measured
        is taken as that one)."""
        best = 0
        for b, d, v, p in zip(self.batch_sizes, self.decode_s, self.verify_s, self._propose):
            if (1 + accepted_per_step) * d <= v + p:
                break
            best = b
        return EVERY_BATCH if best == self.batch_sizes[-1] else best

    @property
    def _propose(self) -> tuple[float, ...]:
        return self.propose_s or (0.0,) * len(self.batch_sizes)

    def with_propose(self, propose_s: tuple[float, ...]) -> SpecProfile:
        return SpecProfile(self.batch_sizes, self.decode_s, self.verify_s, propose_s)

    def describe(self) -> str:
        rows = [f"{b}: {d * 1e3:.1f}/{v * 1e3:.1f}" + (f"+{p * 1e3:.1f}" if self.propose_s else "")
                for b, d, v, p in zip(self.batch_sizes, self.decode_s, self.verify_s, self._propose)]
        return "batch: decode/verify" + ("+propose" if self.propose_s else "") + " ms " + ", ".join(rows)


def profile_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b <= min(max_num_seqs, PROFILE_MAX_BATCH):
        sizes.append(b)
        b *= 2
    return tuple(sizes)


def measure_verify(runner: TargetRunner, k: int) -> SpecProfile:
    """Decode and verify steps of the target at each profiled batch size (every TP rank runs them,
    in step, as the KV budget's profile)."""
    start = time.perf_counter()
    sizes = profile_batch_sizes(runner.config.scheduler.max_num_seqs)
    context = min(PROFILE_CONTEXT, runner.configured_max_model_len - k - 1)
    decode = tuple(best_seconds(lambda: runner.profile_step(b, 1, context), runner.device) for b in sizes)
    verify = tuple(best_seconds(lambda: runner.profile_step(b, k + 1, context, num_draft_tokens=k), runner.device)
                   for b in sizes)
    logger.info("speculative decoding: decode and verify steps (%d drafts) profiled in %.1f s", k,
                time.perf_counter() - start)
    return SpecProfile(sizes, decode, verify)
