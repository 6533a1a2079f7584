"""Attention backends: `torch` (reference, CPU) and `flash_attn` (CUDA, when importable)."""
from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionMetadata, BaseAttentionBackend

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "BaseAttentionBackend", "create_attention_backend", "flash_attn_available"]


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> BaseAttentionBackend:
    """`auto` picks flash_attn on CUDA in fp16/bf16 when importable, else torch; it logs which runs and why."""
    if name == "auto":
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
            name = "flash_attn"
        else:
            why = ("no CUDA device" if device.type != "cuda" else
                   "flash_attn needs fp16/bf16" if dtype == torch.float32 else "flash_attn is not installed")
            logger.info("attention backend: torch (%s)", why)
            name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "flash_attn":
        from engine.attention.flash_backend import FlashAttentionBackend
        logger.info("attention backend: flash_attn")
        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or flash_attn")
