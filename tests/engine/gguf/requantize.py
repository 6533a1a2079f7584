"""A float GGUF rewritten with its decoder linears in Q4_0 or Q4_1, as llama.cpp's `quantize` writes a
pure Q4 file (`--pure`): attention, the dense MLP, a mixture's stacked experts and shared expert in
4 bits by gguf's own quantizer (bit for bit llama.cpp's for these types); the router (`ffn_gate_inp`,
which llama.cpp never quantizes), norms, embeddings and head as they were; metadata copied."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

# llama.cpp's quantized decoder linears, by their GGUF names
QUANTIZED = re.compile(r"^blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down)(_exps|_shexp)?)\.weight$")


def requantize(src: Path, dst: Path, kind: gguf.GGMLQuantizationType,
               others: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """others: a type in place of `kind` for the quantized tensors whose names contain a key."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):  # the writer's own
            continue
        kind_of = field.types[0]
        sub = field.types[-1] if kind_of == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_of, sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if QUANTIZED.match(tensor.name):
            this = next((k for part, k in (others or {}).items() if part in tensor.name), kind)
            writer.add_tensor(tensor.name, gguf.quants.quantize(data.astype(np.float32), this), raw_dtype=this)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
