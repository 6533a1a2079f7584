"""Control messages: a part's trailer crosses in chunks that fit a message and come back whole;
malformed messages are refused."""
from __future__ import annotations

import msgpack
import pytest

from kvtransfer import wire
from kvtransfer.control import MAX_MESSAGE_BYTES


def done(**kw) -> dict:
    return {"kind": "done", "request_id": "r", "head_start": 0, "num_layers": 30, "trailer_bytes": 0,
            "checksum": None, "mac": None, **kw}


@pytest.mark.parametrize("size", [0, 1, wire.TRAILER_CHUNK_BYTES, 2 * wire.TRAILER_CHUNK_BYTES + 3])
def test_a_trailer_crosses_in_chunks_that_fit_a_message(size):
    """Each chunk, with a 200-character request id, is a well-formed message under the control
    channel's bound; joined in order they are the trailer (none for an empty one)."""
    trailer = bytes(i % 251 for i in range(size))
    msgs = wire.trailer_messages("x" * 200, 0, trailer)
    assert len(msgs) == -(-size // wire.TRAILER_CHUNK_BYTES)
    raws = [msgpack.packb(m) for m in msgs]
    assert all(len(raw) < MAX_MESSAGE_BYTES for raw in raws)
    got = [wire.check_message(msgpack.unpackb(raw), wire.SCHEMA) for raw in raws]
    assert b"".join(m["data"] for m in got) == trailer


@pytest.mark.parametrize("data", [b"", b"x" * (wire.TRAILER_CHUNK_BYTES + 1), "text", None])
def test_malformed_trailer_chunks_refused(data):
    with pytest.raises(wire.WireError):
        wire.check_message({"kind": "trailer", "request_id": "r", "head_start": 0, "data": data}, wire.SCHEMA)


@pytest.mark.parametrize("trailer_bytes", [-1, True, 1.0, None])
def test_malformed_trailer_length_refused(trailer_bytes):
    with pytest.raises(wire.WireError):
        wire.check_message(done(trailer_bytes=trailer_bytes), wire.SCHEMA)


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
