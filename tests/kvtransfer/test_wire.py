"""Wire frames: a done message with the most logprobs fits one header; malformed ones are refused."""
from __future__ import annotations

import pytest

from engine.request import SamplingParams
from kvtransfer import wire


def done(**kw) -> dict:
    return {"kind": "done", "request_id": "r", "num_layers": 30, "first_token": 5, "logprobs": None, **kw}


def test_largest_done_message_round_trips():
    """The sampled token plus the most top logprobs a request may ask for, with a 200-character id."""
    n = 20
    SamplingParams(logprobs=n)  # the engine's own bound
    with pytest.raises(ValueError):
        SamplingParams(logprobs=n + 1)
    logprobs = {49151 - k: -1e-7 - k * 1.234567890123 for k in range(n + 1)}
    msg = done(request_id="x" * 200, first_token=49151, logprobs=wire.pack_logprobs(logprobs))
    got = wire.decode_frame(wire.encode_frame(msg))
    assert got == msg and wire.unpack_logprobs(got["logprobs"]) == logprobs


@pytest.mark.parametrize("logprobs", [[[1]], [[1, 2]], [["a", -1.0]], [[True, -1.0]], [1, -1.0], "x"])
def test_malformed_logprobs_refused(logprobs):
    with pytest.raises(wire.WireError):
        wire.decode_frame(wire.encode_frame(done(logprobs=logprobs)))
