"""What a prefill instance hands a decode instance with a request's KV: the first token and, when
the request asked, its extras (engine/core/extras.py: logprobs); with n > 1, the other choices'
first tokens (each sampled from the same logits); and a speculative proposer's rows of the prompt (engine/speculative/rows.py), when
the two instances ship them. One message, packed by the prefill's rank 0 into the KV transfer's
trailer (kvtransfer/base.py: bytes the transport carries unread) and unpacked by the decode's rank
0 as the request's KV is complete.

Packed with msgpack as a map {t: first token, x: extras or nil, c: choices as [[token, extras or
nil], ...], rows: nil or [first position, width, dtype, bytes]}. `Handover.unpack` checks every
field's type and shape (the extras' fields by engine/core/extras.py FIELDS) and raises HandoverError
naming the first one wrong: a malformed trailer fails its request, never the instance.

A new per-token output field changes nothing here (it is one of the extras), nor the transport.
Both ends name the format (`trailer_format`) in their KV compat record.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from engine.core.extras import Extras, misfit

FORMAT = "handover-2"
ROW_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
_FIELDS = {"t", "x", "c", "rows"}


class HandoverError(ValueError):
    """A trailer that is not a well-formed handover."""


def trailer_format(rows_signature: str) -> str:
    """The compat record's name of what the trailers hold: this format, and the proposer rows they
    carry (engine/speculative/registry.py rows_signature; "" none), on which both ends must agree."""
    return FORMAT + (f"+rows:{rows_signature}" if rows_signature else "")


@dataclass(frozen=True)
class Handover:
    first_token: int
    extras: Extras | None = None  # the first token's, when the request asked for any
    more_choices: tuple = ()  # n > 1: the other choices' (first token, extras or None)
    rows: tuple[int, torch.Tensor] | None = None  # a proposer's rows of the prompt: (first position, (tokens, width))

    def pack(self) -> bytes:
        rows = None
        if self.rows is not None:
            start, tensor = self.rows
            tensor = tensor.detach().to("cpu").contiguous()
            rows = [start, tensor.shape[1], str(tensor.dtype).removeprefix("torch."),
                    tensor.view(torch.uint8).numpy().tobytes()]
        return msgpack.packb({"t": self.first_token, "x": self.extras,
                              "c": [[token, extras] for token, extras in self.more_choices], "rows": rows})

    @classmethod
    def unpack(cls, data: bytes) -> Handover:
        """Raises HandoverError (one line) for anything but what `pack` makes."""
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=False)  # extras map token ids
        except Exception as exc:  # msgpack's errors have no common base but Exception
            raise HandoverError(f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(msg, dict) or set(msg) != _FIELDS:
            raise HandoverError(f"fields {sorted(msg) if isinstance(msg, dict) else type(msg).__name__}, "
                                f"want {sorted(_FIELDS)}")
        if type(msg["t"]) is not int or msg["t"] < 0:
            raise HandoverError("the first token is not a token id")
        if not isinstance(msg["c"], list) or not all(_is_choice(c) for c in msg["c"]):
            raise HandoverError("the choices are not [token id, extras or nil] pairs")
        for extras in [msg["x"], *(c[1] for c in msg["c"])]:
            wrong = None if extras is None else misfit(extras)
            if wrong is not None:
                raise HandoverError(wrong)
        return cls(msg["t"], msg["x"], tuple((token, extras) for token, extras in msg["c"]), _unpack_rows(msg["rows"]))


def _unpack_rows(rows) -> tuple[int, torch.Tensor] | None:
    if rows is None:
        return None
    if not (isinstance(rows, list) and len(rows) == 4 and type(rows[0]) is int and rows[0] >= 0
            and type(rows[1]) is int and rows[1] > 0 and rows[2] in ROW_DTYPES and isinstance(rows[3], bytes)):
        raise HandoverError("rows are not [first position, width, dtype, bytes]")
    start, width, dtype, data = rows[0], rows[1], ROW_DTYPES[rows[2]], rows[3]
    if not data or len(data) % (width * dtype.itemsize):
        raise HandoverError(f"{len(data)} bytes of rows {width} {rows[2]} wide")
    return start, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(-1, width)


def _is_choice(choice) -> bool:
    return isinstance(choice, list) and len(choice) == 2 and type(choice[0]) is int and choice[0] >= 0
