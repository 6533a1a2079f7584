"""Control messages: a done message with the most logprobs fits and round-trips; malformed ones are refused."""
from __future__ import annotations

import msgpack
import pytest

from engine.request import SamplingParams
from kvtransfer import wire
from kvtransfer.control import MAX_MESSAGE_BYTES


def done(**kw) -> dict:
    return {"kind": "done", "request_id": "r", "head_start": 0, "num_layers": 30, "first_token": 5,
            "logprobs": None, "more_choices": [], "checksum": None, "mac": None, **kw}


def test_largest_done_message_round_trips():
    """The sampled token plus the most top logprobs a request may ask for, with a 200-character id."""
    n = 20
    SamplingParams(logprobs=n)  # the engine's own bound
    with pytest.raises(ValueError):
        SamplingParams(logprobs=n + 1)
    logprobs = {49151 - k: -1e-7 - k * 1.234567890123 for k in range(n + 1)}
    msg = done(request_id="x" * 200, first_token=49151, logprobs=wire.pack_logprobs(logprobs))
    raw = msgpack.packb(msg)
    assert len(raw) < MAX_MESSAGE_BYTES
    got = wire.check_message(msgpack.unpackb(raw), wire.SCHEMA)
    assert got == msg and wire.unpack_logprobs(got["logprobs"]) == logprobs
    # n = 128 choices (the gateway's bound), each with as many logprobs
    msg["more_choices"] = [[49151 - c, wire.pack_logprobs(logprobs)] for c in range(127)]
    raw = msgpack.packb(msg)
    assert len(raw) < MAX_MESSAGE_BYTES and wire.check_message(msgpack.unpackb(raw), wire.SCHEMA) == msg


@pytest.mark.parametrize("more", [[[1]], [[1, [[2]]]], [["a", None]], [[True, None]], [1], "x", None])
def test_malformed_more_choices_refused(more):
    with pytest.raises(wire.WireError):
        wire.check_message(done(more_choices=more), wire.SCHEMA)


@pytest.mark.parametrize("logprobs", [[[1]], [[1, 2]], [["a", -1.0]], [[True, -1.0]], [1, -1.0], "x"])
def test_malformed_logprobs_refused(logprobs):
    with pytest.raises(wire.WireError):
        wire.check_message(done(logprobs=logprobs), wire.SCHEMA)


@pytest.mark.parametrize("msg", [done(extra=1), {"kind": "layer", "request_id": "r", "head_start": 0},
                                 {"kind": "layer", "request_id": "r", "head_start": 0, "layer": True, "count": 1},
                                 {"kind": "nope"}, [1, 2], "layer"])
def test_messages_of_other_shapes_refused(msg):
    with pytest.raises(wire.WireError):
        wire.check_message(msg, wire.SCHEMA)


@pytest.mark.parametrize("checksum", [0, 2**64 - 1, 0x9E3779B97F4A7C15])
def test_done_checksum_round_trips(checksum):
    """Any unsigned 64-bit checksum (xxh3_64's range) crosses msgpack and the schema unchanged."""
    msg = done(checksum=checksum)
    assert wire.check_message(msgpack.unpackb(msgpack.packb(msg)), wire.SCHEMA) == msg


@pytest.mark.parametrize("checksum", [-1, 2**64, True, 1.0, "00ff", [1]])
def test_malformed_checksum_refused(checksum):
    """A checksum that is not an unsigned 64-bit int (a bool is none) is a malformed message."""
    with pytest.raises(wire.WireError):
        wire.check_message(done(checksum=checksum), wire.SCHEMA)


def test_done_without_the_checksum_field_refused():
    """`checksum` is always present (nil without kv_checksum): a done lacking it is malformed."""
    msg = done()
    del msg["checksum"]
    with pytest.raises(wire.WireError):
        wire.check_message(msg, wire.SCHEMA)
