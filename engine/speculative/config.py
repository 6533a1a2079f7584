"""The speculative decoding knobs (`--speculative-method`, `--speculative-model`,
`--num-speculative-tokens`), checked before anything loads."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")  # engine/speculative: one proposer class per name
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # METHODS
    num_speculative_tokens: int = 3  # drafts per sequence per step, at most
    model: str | None = None  # draft_model: the draft's checkpoint (same vocabulary as the target)
    # a batch of more decoding sequences than this never speculates; None: from the profile measured
    # at load and the acceptance measured since (engine/speculative/speculator.py)
    max_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method draft_model needs --speculative-model (the draft's checkpoint)")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"--speculative-model is the draft_model method's; speculative method {self.method} "
                             "reads no model")
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
