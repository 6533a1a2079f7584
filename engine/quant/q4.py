"""The int4 group-wise weight format, and GGUF's Q4_0 / Q4_1 / Q4_K blocks decoded onto it exactly.

Weights of one output row are cut into groups of GROUP_SIZE consecutive input columns; each
group has a scale and a minimum, and each weight a 4-bit code:

    W[n, k] = q[n, k] * scales[n, k // 32] + mins[n, k // 32]        q in 0..15

That is llama.cpp's Q4_1 block as it is (scale d, minimum m, both fp16 in the file), and Q4_0
(`d * (q - 8)`) with mins = -8 d. Decoding a block is exact: the fp16 d and m are held in fp32,
so `q * scale + min` computed in fp32 is bit for bit what `gguf.quants.dequantize` gives.
Q4_K's super-block of 256 weights holds eight such groups of 32, each with a 6-bit scale sc and
minimum m under the super-block's fp16 d and dmin: `d * sc * q - dmin * m`, so scale = d * sc
and min = -(dmin * m), both exact in fp32 (an 11-bit mantissa times a 6-bit integer).

A float checkpoint is quantized onto the same format with gguf's own Q4_1 quantizer
(`quantize_q4_1`: per group, min and (max - min) / 15, both rounded to fp16, as llama.cpp does),
so `--quantization int4` and a Q4_1 GGUF of the same weights hold the same numbers.
"""
from __future__ import annotations

import numpy as np
import torch

# NOTE: gguf is imported where GGUF blocks are read or written, not here: the engine imports this
# module with any checkpoint, and a machine serving safetensors need not have gguf.
GROUP_SIZE = 32  # weights per block in ggml's Q4_0 and Q4_1
Q4_TYPE_NAMES = ("Q4_0", "Q4_1", "Q4_K")  # gguf.GGMLQuantizationType names decoded onto the int4 format
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # type -> (weights, bytes) per block


def decode_q4_blocks(raw: np.ndarray, kind, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K blocks as codes, scales and mins.

    Args:
        raw: the tensor's bytes, any shape (one row of blocks per output row, as the GGUF header reader gives).
        kind: gguf.GGMLQuantizationType Q4_0, Q4_1 or Q4_K.
        shape: (out_features, in_features); in_features a multiple of the type's block.
    Returns:
        qweight (out, in) uint8 in 0..15; scales, mins (out, in // GROUP_SIZE) float32.
    """
    if kind.name not in Q4_TYPE_NAMES:
        raise ValueError(f"not a Q4_0/Q4_1/Q4_K tensor: {kind.name}")
    out_features, in_features = shape
    block, block_bytes = _BLOCK_BYTES[kind.name]
    if in_features % block:
        raise ValueError(f"in_features {in_features} is not a multiple of {kind.name}'s block size {block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // block, block_bytes)
    d = _fp16(blocks[..., 0:2])
    if kind.name == "Q4_K":
        return _decode_q4_k(blocks, d, shape)
    if kind.name == "Q4_0":
        m, nibbles = -8.0 * d, blocks[..., 2:]
    else:
        m, nibbles = _fp16(blocks[..., 2:4]), blocks[..., 4:]
    # byte j of a block holds element j in its low nibble and element j + 16 in its high one
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out_features, in_features)
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    """(..., 2) little-endian fp16 bytes -> (...) float32."""
    return two_bytes.copy().view(np.float16)[..., 0].astype(np.float32)


def _decode_q4_k(blocks: np.ndarray, d: np.ndarray, shape: tuple[int, int]):
    """Q4_K super-blocks (out, n, 144): d, dmin, 12 bytes of packed 6-bit scales and mins, then
    128 bytes of codes, 32 per 64 weights (low nibbles the first 32, high nibbles the next)."""
    from gguf.quants import Q4_K
    out_features, in_features = shape
    dmin = _fp16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # (out * n, 8) each, as gguf unpacks them
    sc, m = sc.reshape(*d.shape, 8).astype(np.float32), m.reshape(*d.shape, 8).astype(np.float32)
    scales = (d[..., None] * sc).reshape(out_features, -1)
    mins = -(dmin[..., None] * m).reshape(out_features, -1)
    qs = blocks[..., 16:].reshape(out_features, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(out_features, in_features)
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins)


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight (out, in) as llama.cpp's Q4_1 would store it, decoded: see `decode_q4_blocks`."""
    import gguf
    w = weight.detach().float().cpu().numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return tuple(t.to(weight.device) for t in decode_q4_blocks(raw, gguf.GGMLQuantizationType.Q4_1, w.shape))


def dequantize_q4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(out, in) weights in `dtype`, computed in fp32 (exact for decoded GGUF blocks)."""
    out_features, in_features = qweight.shape
    groups = qweight.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE).float()
    w = groups * scales.float()[..., None] + mins.float()[..., None]
    return w.view(out_features, in_features).to(dtype)


def random_q4(shape: tuple[int, int], device: torch.device | str = "cpu",
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and mins of a random weight of `shape` (for timing kernels)."""
    out_features, in_features = shape
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=generator)
    scales = torch.rand(out_features, in_features // GROUP_SIZE, generator=generator) * 0.01 + 1e-3
    return q.to(device), scales.to(device), (-8 * scales).to(device)
