"""What a prefill hands a decode with a request's KV (engine/core/request.py): every field round-trips
exactly (the most logprobs, 128 choices, proposer rows of each dtype); anything else is refused
with one line, never half-read."""
from __future__ import annotations

import msgpack
import pytest
import torch

from engine.core.request import FORMAT, Handover, HandoverError, SamplingParams, trailer_format

TOP = 20  # the most logprobs a request may ask for (the engine's bound, checked below)


def test_the_largest_handover_round_trips():
    """The sampled token plus 20 top logprobs, for 128 choices (the gateway's n bound)."""
    SamplingParams(logprobs=TOP)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=TOP + 1)
    extras = {"logprobs": {49151 - k: -1e-7 - k * 1.234567890123 for k in range(TOP + 1)}}
    more = tuple((49151 - c, extras if c % 2 else None) for c in range(127))
    got = Handover.unpack(Handover(49151, extras, more).pack())
    assert got == Handover(49151, extras, more)
    assert list(got.extras["logprobs"]) == list(extras["logprobs"])  # order kept: the sampled token first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_proposer_rows_round_trip_bit_equal(dtype):
    rows = (torch.randn(1500, 192) * 50).to(dtype)
    got = Handover.unpack(Handover(7, None, (), (3, rows)).pack())
    assert got.rows[0] == 3 and got.rows[1].dtype == dtype and torch.equal(got.rows[1], rows)
    assert Handover.unpack(Handover(7).pack()).rows is None


def _packed(**fields) -> bytes:
    return msgpack.packb({"t": 5, "x": None, "c": [], "rows": None, **fields})


@pytest.mark.parametrize("data,why", [
    (b"", "not msgpack"), (b"\xc1", "not msgpack"), (msgpack.packb([5]), "fields"),
    (msgpack.packb({"t": 5}), "fields"), (_packed(extra=1), "fields"),
    (_packed(t=-1), "first token"), (_packed(t=True), "first token"), (_packed(t="5"), "first token"),
    (_packed(x={"logprobs": {1: 2}}), "'logprobs' is malformed"), (_packed(x={"logprobs": {"a": -1.0}}), "malformed"),
    (_packed(x={"logprobs": {-1: -1.0}}), "malformed"), (_packed(x={"logprobs": {}}), "malformed"),
    (_packed(x={"logprobs": [[1, -1.0]]}), "malformed"), (_packed(x={"entropy": 1.0}), "unknown extras field"),
    (_packed(x={}), "not a non-empty map"), (_packed(x="x"), "not a non-empty map"),
    (_packed(c=[[1]]), "choices"), (_packed(c=[["a", None]]), "choices"), (_packed(c=[[True, None]]), "choices"),
    (_packed(c=[[1, {"logprobs": {2: 1}}]]), "malformed"), (_packed(c=[[1, [[2]]]]), "non-empty map"),
    (_packed(c="x"), "choices"), (_packed(x={1: 2}), "unknown extras field"),
    (_packed(rows=[0, 4, "float64", b"\0" * 32]), "rows"), (_packed(rows=[0, 0, "float32", b""]), "rows"),
    (_packed(rows=[0, 4, "float32", b"\0" * 15]), "bytes of rows"), (_packed(rows=[0, 4, "float32", b""]), "bytes"),
    (_packed(rows=[-1, 4, "float32", b"\0" * 16]), "rows"), (_packed(rows=[0, 4, "float32"]), "rows"),
])
def test_a_malformed_handover_is_refused_naming_what(data, why):
    with pytest.raises(HandoverError, match=why):
        Handover.unpack(data)


def test_the_format_names_the_rows_both_ends_must_agree_on():
    assert trailer_format("") == FORMAT
    assert trailer_format("eagle3: 192 wide") != trailer_format("draft: 64 wide") != FORMAT
