"""The proposer interface and its registry (engine/speculative/__init__.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.model_runner import ModelInput, ModelRunner
    from engine.speculative.config import SpeculativeConfig

PROPOSERS: dict[str, type[Proposer]] = {}  # --speculative-method name -> class (each module registers its own)


@dataclass(frozen=True)
class SpecSequence:
    """A sequence to propose for: its tokens (prompt and output), at most `k` drafts, and its block
    tables, which hold slots up to position len(token_ids) + k - 1 (the verify step's)."""

    request_id: str
    token_ids: Sequence[int]
    k: int
    block_ids: tuple[list[int], ...] = ()


class Proposer(ABC):
    """Guesses how each sequence continues. `propose` sees every speculating sequence of a step at
    once (a model-based proposer runs them as one batch). Drafts are token ids, proposed
    deterministically: the verifier treats each as a point mass (engine/speculative/rejection.py)."""

    name: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a base shared by methods (heads.HeadProposer) names none
            PROPOSERS[cls.name] = cls

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: ModelRunner | None) -> Proposer:
        """The proposer for `config`, beside the target model's runner."""
        return cls()

    @abstractmethod
    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        """Per sequence, up to its k draft token ids; [] for none."""

    @classmethod
    def load_model(cls, target: ModelRunner) -> ProposerModel | None:
        """What this method runs beside the target on its TP rank 0 (a draft model, a head), loaded
        before the target sizes its KV pool, which then counts it; None: nothing."""
        return None

    def profile_seconds(self, batch_sizes: Sequence[int], k: int, device: torch.device) -> tuple[float, ...]:
        """Seconds of a `propose` of k drafts per batch size (speculation's profile, profile.py)."""
        from engine.speculative.profile import synthetic_seconds
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


def proposer_class(method: str) -> type[Proposer]:
    """The proposer class of a --speculative-method name. Raises ValueError for an unknown one."""
    import engine.speculative.draft_model  # noqa: F401 -- each proposer's module registers its class
    import engine.speculative.heads  # noqa: F401
    import engine.speculative.ngram  # noqa: F401
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[method]


def create_proposer(config: SpeculativeConfig, target: ModelRunner | None = None) -> Proposer:
    """A proposer by its --speculative-method name. Raises ValueError for an unknown one."""
    return proposer_class(config.method).from_config(config, target)
