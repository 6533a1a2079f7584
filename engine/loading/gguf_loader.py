"""Reading a llama.cpp GGUF file: its metadata as a `ModelConfig`, its tensors as HF weights.

A GGUF tensor differs from the Hugging Face parameter it came from in four ways, each undone here
(the file's reader, names and row order: engine/quant/gguf_file.py, which the int4 codes read too):

1. name: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight` (`hf_param_name`, from
   gguf's tensor name map of the file's architecture);
2. shape: ggml lists dimensions fastest-first, so `[in_features, out_features]` is reversed;
3. encoding: blocks of every type (Q4_K, Q6_K, Q8_0, BF16, ...) are dequantized with
   `gguf.quants.dequantize`, but those engine/quant/gguf_codes.py reads as int4 codes;
4. values: in `llama` files the rows of `attn_q` / `attn_k` were permuted from HF's rotate-half
   RoPE layout to llama.cpp's interleaved one (`permute_qk`; `unpermute_qk` puts them back);
   Qwen and Gemma keep HF's rotate-half layout; a `gemma2` or `gemma3` file stores each norm
   (Gemma 3's q/k norms too) as 1 + w;
5. experts: a mixture's `ffn_{gate,up,down}_exps` stack every expert of a layer in one tensor; it
   is cut back into HF's per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...).

Dequantizing a whole model takes seconds, so the result is cached once as an fp32 safetensors
file under `$PDSERVE_CACHE_DIR` (default `~/.cache/pdserve`), keyed by the GGUF's path, size and
mtime; later loads read that file. A run on a file's own 4-bit codes (int4) caches only the
tensors it reads as floats (norms, embeddings, head, routers, linears of other types).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.core.config import ModelConfig, MoEConfig
from engine.core.config import cache_dir as default_cache_dir
from engine.quant.gguf_codes import gguf_code_plan, iter_q4_linears, log_tensor_types
from engine.quant.gguf_file import _STACKED_EXPERTS, _as_hf_rows, hf_param_name, open_gguf, read_gguf_metadata

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")  # general.architecture
# -> the family: its own name, but for these; a `llama` file with experts is Mixtral (its converter's arch)
FAMILY_OF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# whether a mixture's chosen weights are rescaled to sum to 1: llama.cpp's fixed choice per architecture
# (no GGUF key says; transformers' GGUF loader assumes the same)
RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
CACHE_FORMAT_VERSION = "4"  # bump when the conversion changes, so stale caches are not read

def _f32(value) -> float:
    """A float32 metadata value as the short decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    """llama.cpp `{arch}.rope.scaling.*` keys as an HF-style `rope_scaling` dict, or None."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    if kind in (None, "none"):
        if (linear := meta.get(f"{arch}.rope.scale_linear")) is not None:  # older files
            return {"rope_type": "linear", "factor": _f32(linear)}
        return None
    scaling = {"rope_type": kind, "factor": _f32(meta.get(prefix + "factor", 1.0))}
    renames = {"original_context_length": "original_max_position_embeddings",
               "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
    for key, hf_key in renames.items():
        if (value := meta.get(prefix + key)) is not None:
            scaling[hf_key] = value if isinstance(value, int) else _f32(value)
    return scaling


def _family_switches(meta: dict, arch: str, num_layers: int, hidden_size: int, num_heads: int,
                     head_dim: int) -> dict:
    """What each architecture's llama.cpp converter implies or writes beyond the shared keys. A
    Mistral checkpoint converts as `llama`, its sliding window dropped (llama.cpp runs it full)."""
    if arch in ("qwen2", "qwen2moe"):
        return dict(qkv_bias=True)
    if arch in ("qwen3", "qwen3moe"):
        return dict(qk_norm=True)
    if arch == "gemma3":
        # llama.cpp (src/models/gemma3.cpp): with a window, every 6th layer global (an
        # attention.sliding_window_pattern key, a period or a per-layer list, overrides); the
        # sliding layers rotate at rope.freq_base_swa (10000 when absent) unscaled, so without a
        # window every layer is global; queries scaled by head_dim, by hidden / heads for the
        # 62-layer 27B; no attention soft-capping
        window = meta.get("gemma3.attention.sliding_window") or None
        n = meta.get("gemma3.attention.sliding_window_pattern", 6)
        swa = list(n) if isinstance(n, list) else [n == 0 or i % n < n - 1 for i in range(num_layers)]
        types = tuple("sliding_attention" if s and window else "full_attention" for s in swa)
        cap = meta.get("gemma3.final_logit_softcapping")
        return dict(qk_norm=True, sliding_window=window, layer_types=types,
                    sliding_rope_theta=_f32(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
                    query_pre_attn_scalar=hidden_size // num_heads if num_layers == 62 else head_dim,
                    final_logit_softcapping=None if cap is None else _f32(cap))
    if arch != "gemma2":
        return {}
    window = meta.get("gemma2.attention.sliding_window")
    # no query_pre_attn_scalar in the file: llama.cpp scales by head_dim, and by hidden / heads for
    # the 46-layer 27B (llama-model.cpp); the sliding layers are the even ones
    scalar = hidden_size // num_heads if num_layers == 46 else head_dim
    caps = {key: _f32(meta[f"gemma2.{key}"]) for key in ("attn_logit_softcapping", "final_logit_softcapping")
            if meta.get(f"gemma2.{key}") is not None}
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
    return dict(sliding_window=window, layer_types=types if window else (), query_pre_attn_scalar=scalar, **caps)


def _moe(meta: dict, arch: str, family: str, num_layers: int, tensor_names: set[str]) -> MoEConfig | None:
    """A mixture's `MoEConfig` from `{arch}.expert_*` keys; its sparse layers are those with a
    router tensor (`ffn_gate_inp`), the others keep a dense MLP."""
    if not meta.get(f"{arch}.expert_count"):
        return None
    return MoEConfig(num_experts=meta[f"{arch}.expert_count"], top_k=meta[f"{arch}.expert_used_count"],
                     intermediate_size=meta.get(f"{arch}.expert_feed_forward_length")
                     or meta[f"{arch}.feed_forward_length"],
                     renormalize=RENORMALIZE[family],
                     shared_expert_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length", 0),
                     dense_layers=tuple(i for i in range(num_layers)
                                        if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))


def gguf_family(meta: dict) -> str:
    """The family (engine/models) of a GGUF's architecture; Raises ValueError for one not supported."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHS})")
    if arch == "llama" and meta.get("llama.expert_count"):
        return "mixtral"
    return FAMILY_OF_ARCH.get(arch, arch)


def gguf_model_config(path: Path) -> ModelConfig:
    """A `ModelConfig` from a GGUF's metadata (architectures in SUPPORTED_ARCHS)."""
    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    try:
        family = gguf_family(meta)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    arch = meta["general.architecture"]
    tensor_names = {t.name for t in reader.tensors}
    num_heads = meta[f"{arch}.attention.head_count"]
    hidden_size = meta[f"{arch}.embedding_length"]
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        vocab_size = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    if "rope_freqs.weight" in tensor_names and _rope_scaling(meta, arch) is None:
        logger.warning("%s has rope_freqs.weight but no rope.scaling metadata; it is ignored", path)
    num_layers = meta[f"{arch}.block_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden_size // num_heads)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=meta.get("general.name") or path.stem,
        architecture=family,
        moe=_moe(meta, arch, family, num_layers, tensor_names),
        **_family_switches(meta, arch, num_layers, hidden_size, num_heads, head_dim),
    )


def _dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as fp32 in HF shape (ggml shape reversed)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                         "which the gguf package cannot dequantize") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # NOTE: np.array copies out of the read-only memmap, so torch owns writable memory.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def convert_gguf(path: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of a llama GGUF, dequantized to fp32, under HF names with HF shapes and row order;
    but those whose HF name (a stack of experts: its stacked name) is in `skip`."""
    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    try:
        gguf_family(meta)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    arch = meta["general.architecture"]
    num_heads = meta[f"{arch}.attention.head_count"]
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    num_layers = meta[f"{arch}.block_count"]
    weights = {}
    for tensor in tqdm(reader.tensors, desc=f"Converting {path.name}", unit="tensor", leave=False):
        name = hf_param_name(tensor.name, arch, num_layers)
        if name is None or name in skip:
            continue
        w = _as_hf_rows(_dequantize(tensor), name, arch, num_heads, num_kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # its converter stored 1 + w
            w = w - 1
        if (m := _STACKED_EXPERTS.match(name)) is not None:  # (experts, out, in): one tensor per expert,
            for e in range(w.shape[0]):                      # as a HF checkpoint names them
                weights[f"{m['layer']}.mlp.experts.{e}.{m['proj']}.weight"] = w[e].clone()
            continue
        weights[name] = w
    return weights




def cache_path_for(path: Path, cache_dir: str | os.PathLike | None = None, variant: str = "") -> Path:
    """Where the converted fp32 copy of a GGUF lives: keyed by its resolved path, size and mtime;
    `variant` names a partial copy ("no-q4-codes": all but the linears read as int4 codes)."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    stat = path.stat()
    key = f"{CACHE_FORMAT_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"{path.stem}-{digest}{'-' + variant if variant else ''}.safetensors"


def _write_atomically(weights: dict[str, torch.Tensor], target: Path, source: Path) -> None:
    """Write to a temp file in the same folder, then rename: readers never see a partial cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(weights, tmp, metadata={"source": source.name, "version": CACHE_FORMAT_VERSION})
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache dir should stay readable
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def iter_gguf_weights(path: Path, dtype: torch.dtype, cache_dir: str | os.PathLike | None = None,
                      q4_codes: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` in `dtype`, converting once and reading the fp32 cache after.

    q4_codes: the decoder linears engine/quant/gguf_codes.py's plan reads as codes, as codes
        (`iter_q4_linears`), the rest as floats (a cache of its own holds only those: a Q4
        mixture's experts are most of the file, and in fp32 eight times its size)."""
    plan = gguf_code_plan(path) if q4_codes else None
    log_tensor_types(path, plan, dtype)
    skip = frozenset()
    if plan is not None:
        yield from iter_q4_linears(path, plan)
        skip = plan.hf_names
    cached = cache_path_for(path, cache_dir, "no-q4-codes" if skip else "")
    if not cached.exists():
        logger.info("converting %s to %s (one time)", path, cached)
        weights = convert_gguf(path, skip)
        try:
            _write_atomically(weights, cached, path)
        except OSError as e:
            logger.warning("cannot write GGUF cache %s (%s); serving the conversion uncached", cached, e)
            yield from ((name, w.to(dtype)) for name, w in weights.items())
            return
        del weights
    with safe_open(cached, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name).to(dtype)
