"""What a fetch costs this prefill instance, measured (the router's yardstick against computing:
router/fetch.py): each fetch's tokens and its seconds from admission to its KV complete (the calls,
the holder's queue and step, the wire), fitted to seconds = fixed + per_token * tokens by least
squares. A small fetch pays the fixed part (a holder's step boundary, round trips) nearly whole; a
mean over every fetch would hide it.
"""
from __future__ import annotations


class FetchCost:
    def __init__(self):
        self.n = 0
        self.tokens = self.seconds = self.tokens2 = self.tokens_seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.n += 1
        self.tokens += tokens
        self.seconds += seconds
        self.tokens2 += tokens * tokens
        self.tokens_seconds += tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), both >= 0; None before any fetch. With one size of
        fetch only (or a fit with a negative part), the mean per token and no fixed part."""
        if not self.n or self.tokens <= 0:
            return None
        mean = self.seconds / self.tokens
        spread = self.n * self.tokens2 - self.tokens ** 2
        if spread <= 1e-9 * max(1.0, self.tokens2):
            return 0.0, mean
        per_token = (self.n * self.tokens_seconds - self.tokens * self.seconds) / spread
        fixed = (self.seconds - per_token * self.tokens) / self.n
        return (fixed, per_token) if fixed >= 0 and per_token >= 0 else (0.0, mean)

    def figures(self) -> dict[str, float]:
        """For the instance's load report (none before a fetch)."""
        fitted = self.fit()
        return {} if fitted is None else {"kv_fetch_fixed_s": fitted[0], "kv_fetch_s_per_token": fitted[1]}
