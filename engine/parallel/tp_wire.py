"""The TP group's control messages on the wire: msgpack, never pickle, and authenticated.

A rank's followers act on what its driver says (the step, stop, load-time choices) and every rank
acts on what the others report (KV polls, KV budgets). Those messages cross a network whose
rendezvous any process that reaches it may join, so nothing that arrives may choose code to run:

- `WireCodec`: msgpack with four extension types only. A record (dataclass, named tuple or enum) is
  built from a registry of the types allowed to cross, by a stable name (module.qualname), with
  its fields as keywords; a tuple stays a tuple; a torch dtype is looked up by name; a CPU tensor is
  (dtype, shape, raw bytes). Nothing else is constructed.
- `ControlChannel`: each message is sealed as payload | HMAC-SHA256(key, seq | sender | payload)
  and travels as uint8 tensors (its length first, then the sealed bytes) on the gloo control
  group. Every rank makes the same control calls in the same order, so each counts them and all
  agree on `seq`: a message replayed, reordered or moved to another sender fails its MAC. A
  message whose MAC fails is counted, logged and raises `TPAuthError` before any byte of it is
  decoded (the rank's loop then dies, and the controller sees the instance dead).

    sealed:  | msgpack payload ..................... | MAC (32 bytes) |
    MAC  =   HMAC-SHA256(key, seq (8, big endian) | sender rank (4) | payload)
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hmac
import logging
import math
import struct
from typing import Any, Iterable

import msgpack
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAC_BYTES = 32
MAX_MESSAGE_BYTES = 1 << 28  # a length above this is refused before anything is allocated for it
_MAC_HEAD = struct.Struct(">QI")  # seq, sender rank
_TUPLE, _RECORD, _DTYPE, _TENSOR = 1, 2, 3, 4


class TPAuthError(RuntimeError):
    """A control message of the TP group failed its MAC (or its length is impossible): it did not
    come from a rank holding the group's key, in this place of the sequence. It was not decoded."""


def wire_name(cls: type) -> str:
    """The stable name a record type crosses under."""
    return f"{cls.__module__}.{cls.__qualname__}"


class WireCodec:
    """msgpack for the registered record types and plain data (None, bool, int, float, str, bytes,
    list, tuple, dict); `encode` raises TypeError for anything else, `decode` ValueError for a
    record whose name is not registered. decode(encode(x)) == x, types included."""

    def __init__(self, types: Iterable[type]):
        self._types: dict[str, type] = {}
        for cls in types:
            assert dataclasses.is_dataclass(cls) or issubclass(cls, (tuple, enum.Enum)), cls
            self._types[wire_name(cls)] = cls

    def encode(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)

    def decode(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self._ext_hook, raw=False, strict_map_key=False)

    def _default(self, x: Any) -> msgpack.ExtType:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise TypeError(f"a {x.device.type} tensor cannot cross the control group (the step sends those)")
            raw = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return msgpack.ExtType(_TENSOR, self.encode([str(x.dtype).removeprefix("torch."), list(x.shape), raw]))
        if isinstance(x, torch.dtype):
            return msgpack.ExtType(_DTYPE, str(x).removeprefix("torch.").encode())
        name = wire_name(type(x))
        if name in self._types:
            if isinstance(x, enum.Enum):
                fields = x.value
            elif isinstance(x, tuple):  # a named tuple
                fields = list(x)
            else:
                fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
            return msgpack.ExtType(_RECORD, self.encode([name, fields]))
        if type(x) is tuple:
            return msgpack.ExtType(_TUPLE, self.encode(list(x)))
        raise TypeError(f"{name} is not a type allowed to cross the TP group")

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == _TUPLE:
            return tuple(self.decode(data))
        if code == _DTYPE:
            return _dtype(data.decode())
        if code == _TENSOR:
            dtype_name, shape, raw = self.decode(data)
            dtype = _dtype(dtype_name)
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"a tensor of {shape} {dtype} in {len(raw)} bytes")
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if code == _RECORD:
            name, fields = self.decode(data)
            if (cls := self._types.get(name)) is None:
                raise ValueError(f"{name!r} is not a type allowed to cross the TP group")
            if issubclass(cls, enum.Enum):
                return cls(fields)
            return cls(*fields) if issubclass(cls, tuple) else cls(**fields)
        raise ValueError(f"unknown msgpack extension {code}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class ControlChannel:
    """One rank's end of its TP group's control messages (module docstring: sealing, sequence).

    `key`: the group's MAC key, the same on every rank (cluster/ranks/rank.py derives it from the
    cluster secret); an empty key authenticates nothing and is for groups built by hand in one
    host's tests. `types`: the records allowed to cross (TPGroup passes the engine's, engine/parallel/step.py
    engine_types, and its own)."""

    def __init__(self, key: bytes, rank: int, types: tuple[type, ...] = ()):
        self.key, self.rank, self._types = key, rank, types
        self.seq = 0  # control messages so far: the same count on every rank
        self.num_refused = 0

    @functools.cached_property
    def codec(self) -> WireCodec:
        return WireCodec(self._types)

    def broadcast(self, obj: Any, src: int, group) -> Any:
        """Group rank 0's `obj` on every rank (`src`: its global rank); rank 0 gets `obj` itself."""
        seq = self._next()
        if self.rank == 0:
            sealed = self._seal(obj, seq)
            length = torch.tensor([len(sealed)], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=src, group=group)
        n = self._length(length, 0)
        buf = _as_tensor(sealed, n) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=group)
        return obj if self.rank == 0 else self._open(buf.numpy().tobytes(), seq, 0)

    def all_gather(self, obj: Any, size: int, group) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (this rank's own is `obj` itself)."""
        seq = self._next()
        sealed = self._seal(obj, seq)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(lengths, torch.tensor([len(sealed)], dtype=torch.int64), group=group)
        ns = [self._length(t, r) for r, t in enumerate(lengths)]
        parts = [torch.empty(max(ns), dtype=torch.uint8) for _ in range(size)]
        dist.all_gather(parts, _as_tensor(sealed, max(ns)), group=group)
        return [obj if r == self.rank else self._open(parts[r][:ns[r]].numpy().tobytes(), seq, r)
                for r in range(size)]

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _mac(self, seq: int, sender: int, payload: bytes) -> bytes:
        return hmac.digest(self.key, _MAC_HEAD.pack(seq, sender) + payload, "sha256")

    def _seal(self, obj: Any, seq: int) -> bytes:
        payload = self.codec.encode(obj)
        return payload + self._mac(seq, self.rank, payload)

    def _open(self, sealed: bytes, seq: int, sender: int) -> Any:
        payload, mac = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(seq, sender, payload)):
            self._refuse(f"control message {seq} from TP rank {sender} failed its MAC ({len(sealed)} bytes): "
                         f"not from a rank holding this group's key; not decoded")
        return self.codec.decode(payload)

    def _length(self, t: torch.Tensor, sender: int) -> int:
        n = int(t.item())
        if not MAC_BYTES <= n <= MAX_MESSAGE_BYTES:
            self._refuse(f"control message {self.seq} from TP rank {sender} announces {n} bytes: not from this group")
        return n

    def _refuse(self, why: str) -> None:
        self.num_refused += 1
        logger.error("TP rank %d refused a %s", self.rank, why)
        raise TPAuthError(why)


def _as_tensor(data: bytes, size: int) -> torch.Tensor:
    """`data` as a uint8 tensor of `size` bytes, zero-padded."""
    out = torch.zeros(size, dtype=torch.uint8)
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out
