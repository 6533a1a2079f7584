"""The request to place (`RequestMessage`), the instance's state of it (`Request`), and the one
admission check both schedulers make (`check_admission`)."""
from __future__ import annotations

import pickle
import re
from dataclasses import FrozenInstanceError

import pytest

from engine.core.request import Request, RequestMessage, RequestStatus, SamplingParams, check_admission


def test_a_message_is_immutable_and_round_trips_through_pickle():
    """A message's fields cannot be assigned, its prompt is a tuple whatever it was given as, and
    pickling (a Ray call) gives an equal message."""
    msg = RequestMessage("r", [3, 4, 5], SamplingParams(max_tokens=7, n=2), "router-1")
    assert msg.prompt_token_ids == (3, 4, 5)
    with pytest.raises(FrozenInstanceError):
        msg.request_id = "other"
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_a_message_needs_a_prompt():
    """An empty prompt is refused where the message is made, as user input (ValueError)."""
    with pytest.raises(ValueError, match="at least one token"):
        RequestMessage("r", [])


def test_each_instance_makes_its_own_state_of_a_message():
    """`Request.from_message` copies the prompt into a fresh state (waiting, nothing computed, the
    model's EOS set, the message's client): two instances given one message share nothing."""
    msg = RequestMessage("r", [3, 4, 5], SamplingParams(max_tokens=7), "router-1")
    a, b = Request.from_message(msg, frozenset({2})), Request.from_message(msg, frozenset({2}))
    a.prompt_token_ids.append(9)
    a.output_token_ids.append(1)
    assert b.prompt_token_ids == [3, 4, 5] and b.output_token_ids == [] and msg.prompt_token_ids == (3, 4, 5)
    assert (b.status, b.num_computed_tokens, b.eos_token_ids, b.client_id) == (RequestStatus.WAITING, 0,
                                                                             frozenset({2}), "router-1")
    assert b.sampling_params is msg.sampling_params and b.arrival_time > 0


@pytest.mark.parametrize("prompt,params,known,want", [
    ([1] * 8, SamplingParams(), {"r"}, "duplicate request id 'r'"),
    ([1] * 16, SamplingParams(), (), "the prompt has 16 tokens; this model's context is 16 (at most 15 prompt tokens"),
    ([1] * 8, SamplingParams(n=5), (), "n=5 is more choices than this instance runs at once (max_num_seqs 4)"),
])
def test_each_refusal_names_its_reason_in_one_line(prompt, params, known, want):
    """A duplicate id, a prompt that leaves no room to generate in the context, more choices than
    run side by side: each is a ValueError whose one-line message says which."""
    with pytest.raises(ValueError, match=re.escape(want)) as info:
        check_admission(Request("r", prompt, params), max_model_len=16, known_ids=known, max_num_choices=4)
    assert "\n" not in str(info.value)


def test_a_request_that_fits_is_admitted_and_choices_count_only_where_they_run_side_by_side():
    """The longest prompt that leaves one token to generate passes; n above max_num_seqs passes
    where choices never run side by side (a prefill: max_num_choices None)."""
    check_admission(Request("r", [1] * 15, SamplingParams(n=4)), max_model_len=16, known_ids={"q"}, max_num_choices=4)
    check_admission(Request("r", [1] * 15, SamplingParams(n=9)), max_model_len=16)


@pytest.mark.parametrize("salt", ["", "x" * 1025])
def test_a_cache_salt_that_cannot_work_is_refused(salt):
    """A cache salt is 1 to MAX_CACHE_SALT_CHARS characters (an empty one would salt nothing)."""
    with pytest.raises(ValueError, match="cache_salt must be 1 to 1024 characters"):
        SamplingParams(cache_salt=salt)
    assert SamplingParams(cache_salt="t").choice(1).cache_salt == "t"  # every choice of n > 1 keeps it


@pytest.mark.parametrize("prompt", [[1, 2, 300], [-1, 2]])
def test_a_token_outside_the_vocabulary_is_refused_where_the_vocabulary_is_known(prompt):
    """Both schedulers pass their model's vocab_size: an id outside it would index past the embedding
    (an instance's process lost); refused in one line instead. Unchecked without a vocab_size."""
    with pytest.raises(ValueError, match=re.escape("prompt token ids must be in [0, 256)")):
        check_admission(Request("r", prompt, SamplingParams()), max_model_len=16, vocab_size=256)
    check_admission(Request("r", prompt, SamplingParams()), max_model_len=16)
