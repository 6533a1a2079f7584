"""The proposer interface: `Proposer`, what it loads beside the target (`ProposerModel`), and the
runner as speculation reads it (`TargetRunner`). The registry of methods is engine/speculative/registry.py:
this module imports no proposer."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.core.timing import best_seconds

if TYPE_CHECKING:
    from torch import nn

    from engine.core.request import SchedulerOutput
    from engine.core.config import EngineConfig, ModelConfig
    from engine.core.speculative_config import SpeculativeConfig
    from engine.parallel.layers import TPGroup
    from engine.parallel.step import ModelInput

PROFILE_CONTEXT = 256  # tokens of context each profiled sequence reads (profile.py)


@dataclass(frozen=True)
class SpecSequence:
    """A sequence to propose for: its tokens (prompt and output), at most `k` drafts, and its block
    tables, which hold slots up to position len(token_ids) + k - 1 (the verify step's)."""

    request_id: str
    token_ids: Sequence[int]
    k: int
    block_ids: tuple[list[int], ...] = ()


class TargetRunner(Protocol):
    """A model runner as speculative decoding reads it (engine/runner/model_runner.py `ModelRunner`
    is the one there is): the target's, which proposers draft for and verification runs on, or a
    draft model's own. Speculation sits below the runner, so it names the runner by this shape."""

    config: EngineConfig
    model_config: ModelConfig
    model: nn.Module
    tp: TPGroup
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    num_blocks: int
    kv_cache: list
    requests: dict  # request id -> the runner's state of it (block tables, sampling, history, grammar)
    draft: ProposerModel | None  # what speculation runs beside it on rank 0 (`Proposer.load_model`)
    spec_profile: object  # engine/speculative/profile.py SpecProfile, or None

    @property
    def configured_max_model_len(self) -> int: ...

    def update_states(self, sched: SchedulerOutput) -> None: ...

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput: ...

    def model_input(self, input_ids, positions, slots, query_lens, seq_lens, tables, sample_indices,
                    sample_req_ids) -> ModelInput: ...

    def execute_model(self, inp: ModelInput, after_layer=None) -> torch.Tensor | None: ...

    def profile_step(self, num_seqs: int, num_tokens: int, context_len: int, num_draft_tokens: int = 0) -> None: ...


class Proposer(ABC):
    """Guesses how each sequence continues. `propose` sees every speculating sequence of a step at
    once (a model-based proposer runs them as one batch). Drafts are token ids, proposed
    deterministically: the verifier treats each as a point mass (engine/speculative/rejection.py)."""

    name: str

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetRunner | None) -> Proposer:
        """The proposer for `config`, beside the target model's runner."""
        return cls()

    @abstractmethod
    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        """Per sequence, up to its k draft token ids; [] for none."""

    @classmethod
    def load_model(cls, target: TargetRunner) -> ProposerModel | None:
        """What this method runs beside the target on its TP rank 0 (a draft model, a head), loaded
        before the target sizes its KV pool, which then counts it; None: nothing."""
        return None

    def profile_seconds(self, batch_sizes: Sequence[int], k: int, device: torch.device) -> tuple[float, ...]:
        """Seconds of a `propose` of k drafts per batch size (speculation's profile, profile.py): by default, `synthetic_seconds`."""
        return synthetic_seconds(self, batch_sizes, k, device)

    def forget(self, request_id: str) -> None:
        """The request finished, or lost its blocks (preempted): drop what is kept of it."""


class ProposerModel(Protocol):
    """A proposer's model on the target's rank-0 runner (`Proposer.load_model`): its KV pool has as
    many blocks as the target's, and the target's budget counts its bytes per block."""

    reads_target_hidden: bool  # it reads the hidden states of every target step (`observe`)
    num_blocks: int

    def block_bytes(self) -> int:
        """Its KV bytes per block of the target's block size."""

    def give_pool(self, num_blocks: int) -> None:
        """Allocates its KV pool, once the target's is sized."""

    def observe(self, inp: ModelInput, hidden: torch.Tensor) -> None:
        """After each eager forward of the target on rank 0: `hidden` (num_tokens, hidden), the
        final hidden states of every token of `inp` (ModelInput.spans says whose)."""


def synthetic_seconds(proposer: Proposer, batch_sizes: Sequence[int], k: int, device: torch.device
                      ) -> tuple[float, ...]:
    """A proposer's seconds per batch size on sequences of PROFILE_CONTEXT random tokens of a small
    vocabulary (so that n-grams recur)."""
    g = torch.Generator().manual_seed(0)
    seqs = [SpecSequence(f"profile-{i}", torch.randint(0, 200, (PROFILE_CONTEXT,), generator=g).tolist(), k)
            for i in range(max(batch_sizes))]
    return tuple(best_seconds(lambda: proposer.propose(seqs[:b]), device) for b in batch_sizes)
