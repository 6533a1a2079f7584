"""engine/quant/gguf_header.py reads what gguf-py's GGUFReader reads: the same metadata values
(`contents()`) and the same tensors (name, type, shape, sizes, offset, data) on every GGUF of the
tests and the built-in model, on a big-endian file and on value types the fixtures lack; and it
refuses what GGUFReader refuses."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.loading.loader import resolve_model_path
from engine.quant.gguf_header import read_gguf_header

FIXTURES = sorted((Path(__file__).parents[1] / "gguf").glob("*.gguf"))


def assert_same_as_gguf_py(path) -> None:
    reader = gguf.GGUFReader(path)
    header = read_gguf_header(path)
    expected = {name: field.contents() for name, field in reader.fields.items()}
    assert list(header.metadata) == list(expected)
    for key, value in expected.items():
        got = header.metadata[key]
        assert type(got) is type(value) and got == value, key
    assert (header.alignment, header.data_offset) == (reader.alignment, reader.data_offset)
    assert len(header.tensors) == len(reader.tensors)
    for mine, theirs in zip(header.tensors, reader.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (theirs.name, theirs.tensor_type, theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert mine.shape.tolist() == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.parametrize("path", FIXTURES + [None], ids=[p.stem for p in FIXTURES] + ["smollm2"])
def test_files_of_the_tests_read_as_gguf_py_reads_them(path):
    """Each fixture, and the built-in SmolLM2 (a 49k-token vocabulary and its merges)."""
    assert_same_as_gguf_py(path if path is not None else resolve_model_path("smollm2"))


def _write(path: Path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_float32("t.f32", 1e-5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.empty", [])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("c.weight", np.arange(5, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_both_byte_orders(tmp_path, endianess):
    """Scalars of several widths, strings, float, string, nested and empty arrays, tensors of three
    element types, a custom alignment; a file written big-endian too."""
    assert_same_as_gguf_py(_write(tmp_path / "t.gguf", endianess, alignment=64))


def test_refuses_what_gguf_py_refuses(tmp_path):
    """Not a GGUF, a version it cannot read, a truncated tensor: ValueError, as GGUFReader raises."""
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="magic"):
        read_gguf_header(tmp_path / "x.gguf")
    good = _write(tmp_path / "t.gguf").read_bytes()
    (tmp_path / "v.gguf").write_bytes(good[:4] + (9).to_bytes(4, "little") + good[8:])
    with pytest.raises(ValueError, match="version 9"):
        read_gguf_header(tmp_path / "v.gguf")
    (tmp_path / "cut.gguf").write_bytes(good[:-40])  # into the last tensor, past its padding
    with pytest.raises(ValueError, match="past the end"):
        read_gguf_header(tmp_path / "cut.gguf")
