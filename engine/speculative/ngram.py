"""The n-gram proposer (prompt lookup decoding), no model: the last n tokens of a sequence are
looked up in its own history (prompt and output), longest n first (max_n down to min_n), the most
recent earlier occurrence winning; the k tokens that followed it are the proposal. It pays on
copying workloads (repeat, edit or quote a given text or code) and proposes nothing elsewhere."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.speculative.base import Proposer, SpecSequence


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        return [self.lookup(np.asarray(s.token_ids, dtype=np.int64), s.k) for s in seqs]

    def lookup(self, history: np.ndarray, k: int) -> list[int]:
        """The continuation of the longest, most recent earlier match of history's last n tokens."""
        length = history.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # every window of n tokens that starts before the suffix itself, compared with the suffix
            windows = np.lib.stride_tricks.sliding_window_view(history[:length - 1], n)
            hits = np.flatnonzero((windows == history[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return history[start:start + k].tolist()
        return []
