"""The scheduler's side of speculative decoding: which decoding sequences speculate this step
(`plan`), their drafts (`propose`), and what came of them (`record`: the metrics, and the
acceptance that the per-batch decision reads).

Per step, the batch's decoding sequences all speculate or none does: none when there are more of
them than `max_batch`, the size where speculation stops paying (profile.py: the step times
measured at load, the drafts accepted per step measured since). `max_batch` is logged when it
changes (at most once per LOG_EVERY_S). Until a few steps are verified, every draft is taken to be
accepted. A batch over the limit still speculates once in `EXPLORE_EVERY` steps, so the acceptance
keeps being measured.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.core.speculative_config import SpeculativeConfig
from engine.speculative.base import Proposer, SpecSequence
from engine.speculative.profile import EVERY_BATCH, SpecProfile
from engine.speculative.registry import create_proposer

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)

EXPLORE_EVERY = 50  # steps over the limit between two that speculate anyway
MIN_MEASURED = 16  # verified sequence-steps before the measured acceptance is used, and between updates
DECAY = 0.995  # per verified sequence-step: the acceptance follows the workload (over ~200 of them)
LOG_EVERY_S = 30.0  # a limit that moves sooner than this again is logged at debug level


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, profile: SpecProfile | None):
        """`profile` None: `config.max_batch_size` is the limit (it must then be set)."""
        assert profile is not None or config.max_batch_size is not None
        self.config, self.proposer, self.profile = config, proposer, profile
        self.k, self.method = config.num_speculative_tokens, config.method
        self.proposed, self.accepted = [0] * self.k, [0] * self.k  # per draft position, since start
        self.num_verified = 0  # sequence-steps verified, since start
        self._steps, self._accepted = 0.0, 0.0  # decayed sums: sequence-steps, drafts accepted
        self.num_skipped = 0  # steps over the limit since one speculated
        self.max_batch = 0
        self._logged_at: float | None = None
        self._first_measured_logged = False
        self._update_limit()

    @classmethod
    def build(cls, config: SpeculativeConfig, runner: TargetRunner) -> Speculator:
        """The proposer beside `runner`, its cost added to the runner's profile (runner.spec_profile)."""
        proposer = create_proposer(config, runner)
        profile = runner.spec_profile
        if profile is not None:
            profile = profile.with_propose(proposer.profile_seconds(profile.batch_sizes, config.num_speculative_tokens,
                                                                    runner.device))
            logger.info("speculative decoding: %s; %s", config.describe(), profile.describe())
        return cls(config, proposer, profile)

    @property
    def accepted_per_step(self) -> float:
        """Drafts accepted per speculating sequence and step (k until MIN_MEASURED are verified)."""
        return self._accepted / self._steps if self.num_verified >= MIN_MEASURED else float(self.k)

    def _update_limit(self) -> None:
        limit = self.config.max_batch_size or self.profile.max_batch_size(self.accepted_per_step)
        if limit == self.max_batch:
            return
        measured = self.num_verified >= MIN_MEASURED
        # the first limit and the first measured one always; then at most one line per LOG_EVERY_S
        # (an acceptance near a profile step's threshold moves the limit back and forth)
        quiet = self._logged_at is not None and self._first_measured_logged and \
            time.monotonic() - self._logged_at < LOG_EVERY_S
        logger.log(logging.DEBUG if quiet else logging.INFO, "speculative decoding (%s): %s (%.2f drafts accepted "
                   "per step%s)", self.method, "on at every batch size" if limit >= EVERY_BATCH else
                   f"on up to {limit} decoding sequences, off above" if limit else "off at every batch size",
                   self.accepted_per_step, "" if measured else ", before measuring")
        if not quiet:
            self._logged_at, self._first_measured_logged = time.monotonic(), measured
        self.max_batch = limit

    def plan(self, running: Sequence[Request], skip: set[str], max_model_len: int) -> dict[str, int]:
        """This step's speculating sequences, request id -> at most how many drafts: every decoding
        one (not in `skip`) with room for a draft, or none."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in skip]
        if not decoding:
            return {}
        if len(decoding) > self.max_batch:
            self.num_skipped += 1
            if self.num_skipped % EXPLORE_EVERY:
                return {}
        ks = {}
        for r in decoding:
            k = min(self.k, r.sampling_params.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1)
            if k > 0:
                ks[r.request_id] = k
        return ks

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        return self.proposer.propose(seqs) if seqs else []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verified step: `num_accepted` of its `num_drafts` drafts kept."""
        for i in range(num_drafts):
            self.proposed[i] += 1
            self.accepted[i] += i < num_accepted
        self.num_verified += 1
        self._steps = DECAY * self._steps + 1
        self._accepted = DECAY * self._accepted + num_accepted
        if self.config.max_batch_size is None and self.num_verified % MIN_MEASURED == 0:
            self._update_limit()

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def describe(self) -> str:
        """The config and the batch limit now, for /status."""
        limit = ("every batch" if self.max_batch >= EVERY_BATCH else f"up to {self.max_batch} decoding sequences"
                 if self.max_batch else "no batch")
        return f"{self.config.describe()}; on at {limit} ({self.accepted_per_step:.2f} drafts accepted per step)"

    def figures(self) -> dict[str, float]:
        """For /metrics: drafts proposed and accepted per position (labelled method and position),
        the acceptance rate per position, and the batch limit."""
        out = {"spec_max_batch": float(min(self.max_batch, EVERY_BATCH))}
        if (received := getattr(self.proposer, "rows_received", None)) is not None:  # shipped: rows.py
            out["spec_rows_received"] = float(received)
        for i, (p, a) in enumerate(zip(self.proposed, self.accepted)):
            out[f"spec_proposed/{self.method}/{i}"] = float(p)
            out[f"spec_accepted/{self.method}/{i}"] = float(a)
            out[f"spec_acceptance/{self.method}/{i}"] = a / p if p else 0.0
        return out

