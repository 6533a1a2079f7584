"""The n-gram proposer (engine/speculative/ngram.py) and the proposer registry."""
from __future__ import annotations

import pytest

from engine.core.speculative_config import SpeculativeConfig
from engine.speculative import SpecSequence, create_proposer
from engine.speculative.ngram import NgramProposer


def drafts(p: NgramProposer, history: list[int], k: int) -> list[int]:
    return p.propose([SpecSequence("r", history, k)])[0]


def test_the_longest_most_recent_match_is_continued():
    """The last 3 tokens (7 8 9) occurred twice before: the later occurrence's continuation wins;
    with a longer suffix unmatched it falls back to shorter ones."""
    p = NgramProposer(max_n=3)
    history = [7, 8, 9, 1, 2, 5, 7, 8, 9, 3, 4, 6, 7, 8, 9]
    assert drafts(p, history, 3) == [3, 4, 6]
    assert drafts(p, [5, 6, 1, 2, 3, 9, 9, 3], 2) == [9, 9]  # only "3" matches (n=1)
    assert drafts(p, history[:-1] + [42], 3) == []  # 42 never occurred before
    assert drafts(p, [1, 2, 1], 5) == [2, 1]  # a continuation shorter than k, up to the end


def test_a_longer_match_beats_a_more_recent_shorter_one():
    p = NgramProposer(max_n=2)
    # "4 5" occurs at the start (followed by 6); "5" alone occurs later (followed by 0)
    assert drafts(p, [4, 5, 6, 1, 5, 0, 4, 5], 1) == [6]
    assert drafts(NgramProposer(max_n=1), [4, 5, 6, 1, 5, 0, 4, 5], 1) == [0]


def test_unknown_methods_and_bad_sizes_are_refused():
    assert isinstance(create_proposer(SpeculativeConfig("ngram")), NgramProposer)
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'; choose one of ngram, draft_model"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(max_n=1, min_n=2)


@pytest.mark.parametrize("flags, why", [
    (("draft_model", None, None), "draft_model needs --speculative-model"),
    (("ngram", "some.gguf", None), "reads no model"),
    ((None, None, 4), "--num-speculative-tokens needs --speculative-method"),
    (("ngram", None, 0), r"num_speculative_tokens must be in \[1, 16\], got 0"),
    (("ngram", None, 17), "got 17"),
])
def test_speculative_flags_that_cannot_work_are_refused(flags, why):
    with pytest.raises(ValueError, match=why):
        SpeculativeConfig.from_flags(*flags)


def test_speculative_flags():
    assert SpeculativeConfig.from_flags(None, None, None) is None
    assert SpeculativeConfig.from_flags(None, "draft.gguf", 5) == SpeculativeConfig("draft_model", 5, "draft.gguf")
    assert SpeculativeConfig.from_flags("ngram", None, None).num_speculative_tokens == 3
