"""The n-gram proposer (engine/speculative/ngram.py) and the proposer registry."""
from __future__ import annotations

import pytest

from engine.speculative import NgramProposer, create_proposer


def test_the_longest_most_recent_match_is_continued():
    """The last 3 tokens (7 8 9) occurred twice before: the later occurrence's continuation wins;
    with a longer suffix unmatched it falls back to shorter ones."""
    p = NgramProposer(max_n=3)
    history = [7, 8, 9, 1, 2, 5, 7, 8, 9, 3, 4, 6, 7, 8, 9]
    assert p.propose([history], k=3) == [[3, 4, 6]]
    assert p.propose([[5, 6, 1, 2, 3, 9, 9, 3]], k=2) == [[9, 9]]  # only "3" matches (n=1)
    assert p.propose([history[:-1] + [42]], k=3) == [[]]  # 42 never occurred before
    assert p.propose([[1, 2, 1]], k=5) == [[2, 1]]  # a continuation shorter than k, up to the end


def test_a_longer_match_beats_a_more_recent_shorter_one():
    p = NgramProposer(max_n=2)
    # "4 5" occurs at the start (followed by 6); "5" alone occurs later (followed by 0)
    assert p.propose([[4, 5, 6, 1, 5, 0, 4, 5]], k=1) == [[6]]
    assert NgramProposer(max_n=1).propose([[4, 5, 6, 1, 5, 0, 4, 5]], k=1) == [[0]]


def test_unknown_methods_and_bad_sizes_are_refused():
    assert isinstance(create_proposer("ngram", max_n=2), NgramProposer)
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'; choose one of ngram"):
        create_proposer("medusa")
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(max_n=1, min_n=2)
