"""engine/text/tokenizer.py: a request's text decided once: detokenized, cut at a stop string, held back
while a stop string may still be forming; tokens past the stop are counted, not added."""
from __future__ import annotations

import pytest

from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import TextState, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_path(resolve_model_path("smollm2"))


def test_stop_inside_a_batch_cuts_the_text_and_counts_the_tokens_after_it(tokenizer):
    """Fed five tokens at once, a stop completed by the third: the text ends before the stop string,
    two tokens are past it, and later tokens are all past it."""
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    state = TextState(tokenizer, [1], stop=(" of",))
    assert state.feed(ids[:5]) == 2 and state.text == "The capital" and state.stop == " of"
    assert state.num_tokens == 3 and state.take(False) == "The capital"  # stopped: nothing held back
    assert state.feed(ids[5:]) == len(ids) - 5


def test_hold_back_and_min_tokens(tokenizer):
    """Text that may be the start of a stop string waits; stop strings count only from min_tokens on."""
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    state = TextState(tokenizer, [1], stop=("Paris!",))
    assert state.feed(ids) == 0 and state.stop is None
    assert state.take(False) == state.text[:-5] and state.take(True) == state.text[-5:]
    early = TextState(tokenizer, [1], stop=("The",), min_tokens=2)
    assert early.feed(ids) == 0 and early.stop is None  # "The" came with token 1, before min_tokens
