"""What crosses a process is immutable: the request to place, the transfer's description, the
stream events. Each type's fields cannot be assigned, and it round-trips through pickle (a Ray call)."""
from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError, fields

import pytest

from decode_worker.engine import RequestOutput
from engine.core.request import RequestMessage, SamplingParams
from kvtransfer.params import KVEndpoint, KVTransferParams
from prefill_worker.worker import PrefillResult

MESSAGES = [
    RequestMessage("r#0", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=1), "router-1"),
    KVTransferParams("r#0", "decode-0", 1, (KVEndpoint("decode-0", 0, "127.0.0.1", 5000),)),
    PrefillResult("r#0", 7, extras={"logprobs": {7: -0.1}}, num_cached_tokens=8, more_choices=((9, None),)),
    RequestOutput("r#0", [8, 9], True, "length", start=1, new_extras=[{"logprobs": {8: -0.2}}, {"logprobs": {9: -0.3}}]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_is_frozen_and_pickles(msg):
    """Assigning any field raises; pickle gives an equal message."""
    for f in fields(msg):
        with pytest.raises(FrozenInstanceError):
            setattr(msg, f.name, getattr(msg, f.name))
    assert pickle.loads(pickle.dumps(msg)) == msg
