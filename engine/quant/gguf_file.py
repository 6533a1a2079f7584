"""A GGUF file as pdserve reads it: one shared reader per file, and its tensors' names and row
order in Hugging Face's terms. Below both the quantized codes (engine/quant/gguf_codes.py) and the
float conversion (engine/loading/gguf_loader.py), which read the same files."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import gguf
import torch

from engine.quant.gguf_header import GgufFile, read_gguf_header

# The HF modules pdserve's families load; gguf's own tensor name maps say which GGUF tensor each
# one is in a given architecture (Gemma 2's post_attention_layernorm is not Llama's).
_HF_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj",
                     "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.experts.gate_proj",
                     "mlp.experts.up_proj", "mlp.experts.down_proj")
_HF_GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Tensors that are not parameters of the HF model (llama3 RoPE frequency factors).
_SKIPPED = re.compile(r"^(rope_freqs|rope_factors_(long|short))\.weight$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.cache
def _hf_modules(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor base names (`blk.3.attn_q`) -> HF module names, from `gguf.get_tensor_name_map`."""
    enum = {name: e for e, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    tensor_map = gguf.get_tensor_name_map(enum, num_layers)
    hf = list(_HF_GLOBAL_MODULES) + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _HF_LAYER_MODULES]
    return {g: name for name in hf if (g := tensor_map.get_name(name)) is not None}


def open_gguf(path: str | os.PathLike) -> GgufFile:
    """The header of the GGUF at `path` (engine/quant/gguf_header.py), shared by every caller in
    this process until the file changes: the config, the tokenizer and the weights all need it."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open_gguf(str(path), stat.st_size, stat.st_mtime_ns)


def forget_open_readers() -> None:
    """Drops the shared readers: the next `open_gguf` parses its file again (a benchmark's cold load)."""
    _open_gguf.cache_clear()


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GgufFile:
    return read_gguf_header(path)


def read_gguf_metadata(reader: GgufFile) -> dict:
    """All key/value fields of a GGUF as plain Python values (str, int, float, bool, lists); the
    lists are the caller's own (the header is shared)."""
    return {key: list(value) if isinstance(value, list) else value for key, value in reader.metadata.items()}


def hf_param_name(gguf_name: str, arch: str = "llama", num_layers: int | None = None) -> str | None:
    """HF parameter name of a GGUF tensor of `arch`; None for tensors the HF model has no slot for.

    Raises:
        ValueError: a tensor this loader does not know, rather than silently dropping weights.
    """
    if _SKIPPED.match(gguf_name):
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if num_layers is None:
        num_layers = int(m.group(1)) + 1 if (m := _LAYER_RE.match(gguf_name)) else 1
    if suffix in ("weight", "bias") and (module := _hf_modules(arch, num_layers).get(base)) is not None:
        return f"{module}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {arch} counterpart")


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert step: HF rotate-half row order -> interleaved pairs, per head.

    Shape: (num_heads * head_dim, ...) -> same shape, rows reordered.
    """
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _as_hf_rows(w: torch.Tensor, name: str, arch: str, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """A tensor's rows in HF order: only a `llama` file's q/k rows were permuted (`permute_qk`)."""
    if arch == "llama" and ".self_attn.q_proj" in name:
        return unpermute_qk(w, num_heads)
    if arch == "llama" and ".self_attn.k_proj" in name:
        return unpermute_qk(w, num_kv_heads)
    return w


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of `permute_qk`: row `h*hd + 2*i + j` goes back to row `h*hd + j*hd/2 + i`."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# a mixture's stacked experts under their HF name (one tensor per layer and projection)
_STACKED_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<proj>\w+_proj)\.weight$")
