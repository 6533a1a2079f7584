"""A GGUF file's header read in one pass: its metadata as plain Python values and its tensors as
gguf-py's `ReaderTensor`s over one read-only memory map.

gguf-py's `GGUFReader` makes a numpy view of every value it meets: a 49k-token vocabulary and its
merges are ~250k views, 1.5-1.7 s per process here (the gateway's tokenizer and every rank's
config, plan and weights read the same file), where unpacking them with `struct` from the map
takes 0.06 s. The values are what `GGUFReader`'s `ReaderField.contents()` gives (ints, floats,
bools, strings, arrays flattened into one list), the tensors what its `tensors` list holds (the
`field` of each is None): tests/engine/quant/test_gguf_header.py compares both on every GGUF of the
tests, little- and big-endian.

File layout (GGUF v2/v3): magic, version u32, tensor count u64, key/value count u64; each key a
string (u64 length, UTF-8 bytes), a value type u32 and its value (an array: element type u32,
length u64, elements); each tensor's name, dimension count u32, dimensions u64 (fastest first),
ggml type u32 and offset u64 from the data section, which starts at the next multiple of
`general.alignment` (32 by default).
"""
from __future__ import annotations

import mmap
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)
STRING, ARRAY = 8, 9  # gguf.GGUFValueType
# gguf.GGUFValueType of a scalar -> its struct code (standard sizes: 1, 2, 4 or 8 bytes)
SCALAR_TYPES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
PLAIN_TENSOR_TYPES = {GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
                      GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
                      GGMLQuantizationType.I64: "i8"}  # element types; the others are read as bytes


@dataclass
class GgufFile:
    """metadata: key -> value (with `GGUF.version`, `GGUF.tensor_count`, `GGUF.kv_count`, as
    gguf-py lists them); tensors: in file order, each one's `data` a view of the map."""
    path: str
    metadata: dict
    tensors: list[ReaderTensor]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads values of one byte order from a buffer, advancing."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0
        self._u64 = struct.Struct(order + "Q").unpack_from

    def scalar(self, code: str):
        """One value of struct `code`."""
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        (n,) = self._u64(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return str(self.buf[start:self.pos], "utf-8")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array(self.scalar("I"), self.scalar("Q"))
        if kind not in SCALAR_TYPES:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.scalar(SCALAR_TYPES[kind])

    def array(self, kind: int, n: int) -> list:
        """A flat list (an array of arrays flattened, as gguf-py's `contents()` gives it)."""
        if kind == STRING:
            return [self.string() for _ in range(n)]
        if kind == ARRAY:
            return [v for _ in range(n) for v in self.value(ARRAY)]
        if kind not in SCALAR_TYPES:
            raise ValueError(f"unknown GGUF array element type {kind} at byte {self.pos}")
        dtype = np.dtype(self.order + SCALAR_TYPES[kind])
        values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
        self.pos += n * dtype.itemsize
        return values


def read_gguf_header(path: str | os.PathLike) -> GgufFile:
    """The file's metadata and tensors. Raises ValueError where gguf-py's reader would refuse the
    file (magic, version, duplicate keys or tensor names, alignment)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while a tensor's view lives
    if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise ValueError(f"{path}: GGUF magic invalid")
    native, other = ("<", ">") if sys.byteorder == "little" else (">", "<")
    order = native if struct.unpack_from(native + "I", buf, 4)[0] & 0xFFFF else other  # as gguf-py tells them
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.scalar("I")
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version}; readable: {', '.join(map(str, VERSIONS))}")
    tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
    metadata = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for _ in range(kv_count):
        key = cur.string()
        if key in metadata:
            raise ValueError(f"{path}: duplicate GGUF key {key!r}")
        metadata[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = np.array([cur.scalar("Q") for _ in range(cur.scalar("I"))], dtype=np.uint64)
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: invalid general.alignment {alignment!r}")
    data_offset = -(-cur.pos // alignment) * alignment
    return GgufFile(str(path), metadata, _tensors(path, buf, order, infos, data_offset), alignment, data_offset)


def _tensors(path, buf, order: str, infos: list, data_offset: int) -> list[ReaderTensor]:
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"{path}: duplicate GGUF tensor {name!r}")
        names.add(name)
        kind = GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block_size
        np_dims = tuple(reversed(dims.tolist()))
        start = data_offset + int(offset)
        if kind in PLAIN_TENSOR_TYPES:
            dtype, count = np.dtype(PLAIN_TENSOR_TYPES[kind]).newbyteorder(order), n_elements
        else:
            dtype, count, np_dims = np.dtype(np.uint8), n_bytes, quant_shape_to_byte_shape(np_dims, kind)
        if start + count * dtype.itemsize > len(buf):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buf, dtype, count, start).reshape(np_dims)
        tensors.append(ReaderTensor(name, kind, dims, n_elements, n_bytes, start, data, None))
    return tensors
