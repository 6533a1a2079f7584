"""The one load-time timer: the engine's choices measured at load (expert methods, latent-attention
prefill forms, quantized expert kernels, speculative decoding's profile) time their candidates with it."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], device: torch.device, rounds: int = 2) -> float:
    """The least of `rounds` timings of `fn`, after one untimed call (a CUDA device synchronized
    around each)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
