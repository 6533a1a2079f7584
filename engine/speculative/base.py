"""The proposer interface and its registry (engine/speculative/__init__.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

PROPOSERS: dict[str, type[Proposer]] = {}  # --speculative-method name -> class (each module registers its own)


class Proposer(ABC):
    """Guesses how each sequence continues. `propose` sees every speculating sequence of a step at
    once (a model-based proposer runs them as one batch)."""

    name: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        PROPOSERS[cls.name] = cls

    @abstractmethod
    def propose(self, histories: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Per sequence (its prompt and output so far), up to k draft token ids; [] for none."""


def create_proposer(method: str, **kwargs) -> Proposer:
    """A proposer by its --speculative-method name. Raises ValueError for an unknown one."""
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[method](**kwargs)
