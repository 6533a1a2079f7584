"""The wire format of the torch.distributed transport.

Every message is one fixed-size header frame (uint8[HEADER_BYTES]: a 4-byte little-endian length,
then a msgpack map), followed for "layer" messages by one payload of raw bytes:

    layer  {kind, request_id, layer, num_tokens, head_start, head_end}  + payload
           payload = K and V of those heads, (2, num_tokens, head_end - head_start, head_dim)
    done   {kind, request_id, num_layers, first_token, logprobs}        (sender -> receiver)
           logprobs = None, or the first token's [[token_id, logprob], ...] (sampled token first)
    ack    {kind, request_id, ok, error}                                (receiver -> sender)

One frame instead of a length tensor plus a header saves a round of gloo's send/recv rendezvous
per message. Handshake keys live in the receiver's TCPStore (see torch_dist.py).
"""
from __future__ import annotations

import struct

import msgpack
import torch

HEADER_BYTES = 1024  # a done message with 21 logprobs and a long request id fits
_FIELDS = {
    "layer": {"request_id": str, "layer": int, "num_tokens": int, "head_start": int, "head_end": int},
    "done": {"request_id": str, "num_layers": int, "first_token": int, "logprobs": (list, type(None))},
    "ack": {"request_id": str, "ok": bool, "error": (str, type(None))},
}


class WireError(ValueError):
    """A frame that is not a well-formed message."""


def encode_frame(msg: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    body = msgpack.packb(msg)
    if len(body) > HEADER_BYTES - 4:
        raise ValueError(f"header of {len(body)} bytes exceeds {HEADER_BYTES - 4}")
    raw = struct.pack("<I", len(body)) + body
    frame = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    frame[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return frame.to(device)


def decode_frame(frame: torch.Tensor) -> dict:
    """Parses and validates a frame; raises WireError on anything malformed."""
    raw = frame.cpu().numpy().tobytes()
    (length,) = struct.unpack("<I", raw[:4])
    if not 0 < length <= HEADER_BYTES - 4:
        raise WireError(f"bad header length {length}")
    try:
        msg = msgpack.unpackb(raw[4:4 + length])
    except Exception as exc:  # msgpack raises several types on garbage
        raise WireError(f"undecodable header: {exc}") from None
    check_message(msg, _FIELDS)
    if msg.get("logprobs") is not None and not all(_is_logprob_pair(p) for p in msg["logprobs"]):
        raise WireError("done.logprobs is not a list of [token_id, logprob] pairs")
    return msg


def check_message(msg, schema: dict[str, dict[str, type | tuple]]) -> dict:
    """`msg` if it is a map with a "kind" of `schema` and exactly that kind's fields, of those
    types (a bool is no int); WireError naming what is wrong otherwise."""
    if not isinstance(msg, dict) or msg.get("kind") not in schema:
        raise WireError(f"unknown message {str(msg)[:80]!r}")
    spec = schema[msg["kind"]]
    if set(msg) != {"kind", *spec}:
        raise WireError(f"{msg['kind']} message has fields {sorted(msg)}, wants {sorted(spec)}")
    for name, typ in spec.items():
        value = msg[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise WireError(f"{msg['kind']}.{name} has type {type(value).__name__}")
    return msg


def _is_logprob_pair(pair) -> bool:
    return (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
            and isinstance(pair[1], float))


def pack_logprobs(logprobs: dict[int, float] | None) -> list[list] | None:
    """{token_id: logprob} (insertion order kept) -> the wire's pairs."""
    return None if logprobs is None else [[int(t), float(lp)] for t, lp in logprobs.items()]


def unpack_logprobs(pairs: list[list] | None) -> dict[int, float] | None:
    return None if pairs is None else {t: lp for t, lp in pairs}


def payload_bytes(msg: dict, head_dim: int, dtype: torch.dtype) -> int:
    """Size of a layer message's payload."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * msg["num_tokens"] * (msg["head_end"] - msg["head_start"]) * head_dim * elem
