"""The speculative decoding knobs (`--speculative-method`, `--speculative-model`,
`--num-speculative-tokens`), checked before anything loads."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle3", "mtp")  # engine/speculative: one proposer class per name
HEAD_METHODS = ("eagle3", "mtp")  # heads over the target's hidden states (engine/speculative/heads.py)
SHIPPED = ("draft_model", *HEAD_METHODS)  # a prefill instance ships their proposer's state of each prompt (rows.py)
WITH_MODEL = ("draft_model", "eagle3")  # the methods whose drafter is its own checkpoint (--speculative-model)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # METHODS
    num_speculative_tokens: int = 3  # drafts per sequence per step, at most
    # draft_model: the draft's checkpoint (same vocabulary as the target); eagle3: the head's (EAGLE-3 layout)
    model: str | None = None
    # a batch of more decoding sequences than this never speculates; None: from the profile measured
    # at load and the acceptance measured since (engine/speculative/speculator.py)
    max_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.method in WITH_MODEL and not self.model:
            raise ValueError(f"speculative method {self.method} needs --speculative-model (its drafter's checkpoint)")
        if self.method not in WITH_MODEL and self.model:
            raise ValueError(f"--speculative-model is for the {' and '.join(WITH_MODEL)} methods; speculative method "
                             f"{self.method} reads no model of its own")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size must be >= 1, got {self.max_batch_size}")

    @classmethod
    def from_flags(cls, method: str | None, model: str | None, num_tokens: int | None,
                   max_batch_size: int | None = None) -> SpeculativeConfig | None:
        """None without a method; a model alone means draft_model; the other knobs alone are refused."""
        if method is None and model is not None:
            method = "draft_model"
        if method is None:
            for flag, value in (("--num-speculative-tokens", num_tokens), ("--speculative-max-batch-size",
                                                                           max_batch_size)):
                if value is not None:
                    raise ValueError(f"{flag} needs --speculative-method")
            return None
        return cls(method, 3 if num_tokens is None else num_tokens, model, max_batch_size)

    def describe(self) -> str:
        """One line for /status and the load log."""
        model = f" {self.model}" if self.model else ""
        return f"{self.method}{model}, {self.num_speculative_tokens} tokens"
