"""The int4 group-wise weight format, and GGUF's Q4_0 / Q4_1 blocks decoded onto it exactly.

Weights of one output row are cut into groups of GROUP_SIZE consecutive input columns; each
group has a scale and a minimum, and each weight a 4-bit code:

    W[n, k] = q[n, k] * scales[n, k // 32] + mins[n, k // 32]        q in 0..15

That is llama.cpp's Q4_1 block as it is (scale d, minimum m, both fp16 in the file), and Q4_0
(`d * (q - 8)`) with mins = -8 d. Decoding a block is exact: the fp16 d and m are held in fp32,
so `q * scale + min` computed in fp32 is bit for bit what `gguf.quants.dequantize` gives.

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
Q4_TYPE_NAMES = ("Q4_0", "Q4_1")  # gguf.GGMLQuantizationType names


def decode_q4_blocks(raw: np.ndarray, kind, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks as codes, scales and mins.

    Args:
        raw: the tensor's bytes, any shape (one row of blocks per output row, as GGUFReader gives).
        kind: gguf.GGMLQuantizationType Q4_0 or Q4_1.
        shape: (out_features, in_features); in_features a multiple of GROUP_SIZE.
    Returns:
        qweight (out, in) uint8 in 0..15; scales, mins (out, in // GROUP_SIZE) float32.
    """
    if kind.name not in Q4_TYPE_NAMES:
        raise ValueError(f"not a Q4_0/Q4_1 tensor: {kind.name}")
    out_features, in_features = shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"in_features {in_features} is not a multiple of the block size {GROUP_SIZE}")
    block_bytes = 18 if kind.name == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // GROUP_SIZE, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind.name == "Q4_0":
        m, nibbles = -8.0 * d, blocks[..., 2:]
    else:
        m, nibbles = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    # byte j of a block holds element j in its low nibble and element j + 16 in its high one
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out_features, in_features)
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))


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
