"""Which tensors of a GGUF run on their own 4-bit codes, and reading them (engine/quant/q4.py).

The files people download are mixes: llama.cpp's Q4_K_M writes most decoder linears as Q4_K, but
attn_v and ffn_down as Q6_K in about a third of the layers, and the head as Q6_K; where a row is
not a multiple of 256 weights it falls back to Q5_0, Q5_1 or Q8_0. So the choice is made per
tensor, by the file's types (`gguf_code_plan`):

- a dense decoder linear is read as int4 codes (`iter_q4_linears`) when its type decodes exactly
  onto the int4 format (Q4_0, Q4_1, Q4_K) and so do the tensors the model fuses with it into one
  layer (q, k and v into qkv_proj; gate and up into gate_up_proj): a layer holds one format;
- a mixture's experts are codes when every expert stack of the file is (the experts of a model
  hold one format); else they are dequantized, every one;
- every other tensor is dequantized by gguf-py (engine/loading/gguf_loader.py) into the model dtype.

Why Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 are dequantized rather than run as int8: their scales are per
group of 16 or 32 weights, and torch's int8 kernel (`_weight_int8pack_mm`) takes one scale per
output row, so running them as int8 would mean requantizing, a second rounding the file does not
have. Q2_K and Q3_K have 2- and 3-bit codes but groups of 16, and torch's int4 kernel takes groups
of 32 or more. BENCHMARKS.md ("GGUF tensor types") has the load and step times of each type.
"""
from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.quant.gguf_file import _LAYER_RE, _STACKED_EXPERTS, _as_hf_rows, hf_param_name, open_gguf

logger = logging.getLogger(__name__)

LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
           "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",  # a mixture's experts, every one of a layer stacked
           "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}  # Qwen2-MoE's shared expert
# GGUF linears the model fuses into one layer (engine/models/llama.py packed_modules_mapping)
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
          "ffn_gate_shexp": "shared_gate_up", "ffn_up_shexp": "shared_gate_up"}


@dataclass(frozen=True)
class CodePlan:
    """codes: the GGUF tensor names read as int4 codes; hf_names: their HF names (a stack of
    experts: its stacked name), which the float conversion skips; experts: whether a mixture's
    are among them."""
    codes: frozenset[str]
    hf_names: frozenset[str]
    experts: bool


def decoder_linears(reader) -> list:
    """The decoder's linear weights of a GGUF (its reader's tensors), a mixture's expert stacks too."""
    return [t for t in reader.tensors if (m := _LAYER_RE.match(t.name)) and m.group(2) in LINEARS
            and m.group(3) == "weight"]


def gguf_code_plan(path: str | os.PathLike) -> CodePlan:
    """Which decoder linears of the GGUF at `path` run on their codes (the module docstring's rules)."""
    from engine.quant.q4 import Q4_TYPE_NAMES
    reader = open_gguf(path)
    arch = reader.metadata["general.architecture"]
    layers = reader.metadata[f"{arch}.block_count"]
    groups: dict[tuple, list] = {}
    for t in decoder_linears(reader):
        m = _LAYER_RE.match(t.name)
        key = ("experts",) if m.group(2).endswith("_exps") else (m.group(1), _FUSED.get(m.group(2), m.group(2)))
        groups.setdefault(key, []).append(t)
    coded = {key for key, ts in groups.items() if all(t.tensor_type.name in Q4_TYPE_NAMES for t in ts)}
    codes = frozenset(t.name for key in coded for t in groups[key])
    return CodePlan(codes, frozenset(hf_param_name(name, arch, layers) for name in codes), ("experts",) in coded)


def describe_tensor_types(path: str | os.PathLike, plan: CodePlan | None) -> str:
    """Per tensor type of the file, how many tensors run on codes and how many are dequantized:
    `Q4_K: 112 int4 codes, 8 dequantized; Q6_K: 25 dequantized; F32: 61 dequantized`."""
    codes, dequantized = Counter(), Counter()
    for t in open_gguf(path).tensors:
        (codes if plan is not None and t.name in plan.codes else dequantized)[t.tensor_type.name] += 1
    parts = []
    for kind in sorted(codes.keys() | dequantized.keys()):
        counts = [f"{codes[kind]} int4 codes" if codes[kind] else "", f"{dequantized[kind]} dequantized"
                  if dequantized[kind] else ""]
        parts.append(f"{kind}: {', '.join(c for c in counts if c)}")
    return "; ".join(parts)


def log_tensor_types(path: str | os.PathLike, plan: CodePlan | None, dtype: torch.dtype) -> None:
    logger.info("GGUF %s tensor types: %s (dequantized: by gguf-py, to %s)", Path(path).name,
                describe_tensor_types(path, plan), str(dtype).removeprefix("torch."))


def iter_q4_linears(path: Path, plan: CodePlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Each decoder linear of `plan.codes` as its codes, scales and mins (engine/quant/q4.py):
    `...q_proj.qweight` (out, in) uint8, `...q_proj.scales` and `...q_proj.mins` (out, in / 32)
    fp32, rows in HF order (q and k unpermuted like the float weights); a mixture's stacked
    experts cut into HF's per-expert names (`...mlp.experts.5.gate_proj.qweight`)."""
    from engine.quant.q4 import decode_q4_blocks
    reader = open_gguf(path)
    meta = reader.metadata
    arch = meta["general.architecture"]
    num_heads, num_layers = meta[f"{arch}.attention.head_count"], meta[f"{arch}.block_count"]
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    for tensor in decoder_linears(reader):
        if tensor.name not in plan.codes:
            continue
        name = hf_param_name(tensor.name, arch, num_layers)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # (experts, out, in) for stacked experts
        parts = decode_q4_blocks(tensor.data, tensor.tensor_type, (math.prod(shape[:-1]), shape[-1]))
        if (m := _STACKED_EXPERTS.match(name)) is not None:
            for suffix, part in zip(("qweight", "scales", "mins"), parts):
                for e, rows in enumerate(part.view(shape[0], shape[1], -1)):
                    yield f"{m['layer']}.mlp.experts.{e}.{m['proj']}.{suffix}", rows.clone()
            continue
        name = name.removesuffix(".weight")
        for suffix, part in zip(("qweight", "scales", "mins"), parts):
            yield f"{name}.{suffix}", _as_hf_rows(part, name, arch, num_heads, num_kv_heads).contiguous()
