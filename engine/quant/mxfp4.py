"""MXFP4 weights (OCP Microscaling spec) as OpenAI's gpt-oss checkpoints ship their expert weights.

Blocks of BLOCK_SIZE = 32 consecutive values along the input (last) dimension share one scale:

    W[..., r, 32 * g + j] = e2m1(code[..., r, 32 * g + j]) * 2 ** (scales[..., r, g] - 127)

Each element is an FP4 E2M1 code: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, so codes
0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same negated. The scale is E8M0: an
unsigned byte e meaning 2 ** (e - 127); 255 is NaN in the spec and rejected here.

gpt-oss stores a weight of logical shape (..., rows, cols) as two uint8 tensors:

    <name>_blocks  (..., rows, cols / 32, 16)   two codes a byte: low nibble = element 2k,
                                                high nibble = element 2k + 1
    <name>_scales  (..., rows, cols / 32)       one E8M0 byte per block

    byte k of block g:  [ hi: code 32g+2k+1 | lo: code 32g+2k ]

The experts: `mlp.experts.gate_up_proj_blocks` (E, 2 * I, H / 32, 16) with scales (E, 2 * I, H / 32)
and `mlp.experts.down_proj_blocks` (E, H, I / 32, 16) with scales (E, H, I / 32), which decode to
(E, 2 * I, H) and (E, H, I): (out, in) per expert. Unlike transformers' `_convert_moe_packed_tensors`
we do not transpose.

Decoding is exact: an E2M1 value has at most 2 significant bits and the scale is a power of two
taken from an exact table, so the fp32 product is exact, and so is its cast to bf16 (same exponent
range); only values beyond the dtype's range (6 * 2 ** 127 in fp32, most of fp16's) are not.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 32  # elements sharing one E8M0 scale
BYTES_PER_BLOCK = BLOCK_SIZE // 2
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2  # exponent of the largest E2M1 value, 6 = 1.5 * 2 ** 2
E2M1_MAX = 6.0
CHUNK_ELEMENTS = 1 << 22  # output elements decoded at a time: temporaries ~6 bytes each (fp32 + int32 / 2)


def e2m1_values() -> list[float]:
    """The 16 E2M1 values by code, derived from the bit layout (sign, 2-bit exponent bias 1, 1-bit mantissa)."""
    values = []
    for code in range(16):
        sign, exp, man = (code >> 3) & 1, (code >> 1) & 3, code & 1
        magnitude = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
        values.append(-magnitude if sign else magnitude)
    return values


def _e8m0_table(device: torch.device) -> torch.Tensor:
    """2 ** (e - 127) for every byte e, exact in fp32 (2 ** -127 is an fp32 subnormal); NaN at 255."""
    table = [2.0 ** (e - E8M0_BIAS) for e in range(E8M0_NAN)] + [float("nan")]
    return torch.tensor(table, dtype=torch.float32, device=device)


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"expected blocks (..., rows, cols / {BLOCK_SIZE}, {BYTES_PER_BLOCK}) and scales "
                         f"(..., rows, cols / {BLOCK_SIZE})")
    num_nan = int((scales == E8M0_NAN).sum())
    if num_nan:
        raise ValueError(f"MXFP4 scales hold {num_nan} NaN byte(s) ({E8M0_NAN}) of {scales.numel()}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     *, rows_per_chunk: int | None = None) -> torch.Tensor:
    """MXFP4 blocks and scales in gpt-oss's layout as a float tensor, exact where `dtype` can hold it.

    Args:
        blocks: uint8 (..., rows, cols / 32, 16), two E2M1 codes a byte (low nibble first).
        scales: uint8 (..., rows, cols / 32), E8M0 exponents; 255 (NaN) is rejected.
        dtype: the output dtype.
        rows_per_chunk: rows decoded at a time (default: about CHUNK_ELEMENTS elements), so peak
            memory is the output plus small fp32 temporaries, never a full-size fp32 copy.
    Returns:
        (..., rows, cols) in `dtype`, on blocks' device; not transposed.
    Raises:
        ValueError: non-uint8 inputs, mismatched shapes, or NaN scale bytes.
    """
    _check_packed(blocks, scales)
    *prefix, num_groups, _ = blocks.shape
    cols = num_groups * BLOCK_SIZE
    blocks = blocks.reshape(-1, num_groups, BYTES_PER_BLOCK)  # (rows, groups, 16)
    scales = scales.reshape(-1, num_groups)  # (rows, groups)
    num_rows = blocks.shape[0]
    out = torch.empty(num_rows, cols, dtype=dtype, device=blocks.device)
    if rows_per_chunk is None:
        rows_per_chunk = max(1, CHUNK_ELEMENTS // max(cols, 1))

    # one lookup per byte gives its (even, odd) element pair in order
    values = torch.tensor(e2m1_values(), dtype=torch.float32, device=blocks.device)
    codes = torch.arange(256, device=blocks.device)
    pair_table = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)  # (256, 2)
    scale_table = _e8m0_table(blocks.device)  # (256,)
    for r0 in range(0, num_rows, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, num_rows)
        pairs = pair_table[blocks[r0:r1].int()]  # (chunk, groups, 16, 2)
        chunk = pairs.view(r1 - r0, num_groups, BLOCK_SIZE)  # (chunk, groups, 32)
        chunk *= scale_table[scales[r0:r1].int()].unsqueeze(-1)  # exact: times a power of two
        out[r0:r1] = chunk.view(r1 - r0, cols)
    return out.view(*prefix, cols)


def _round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of y's nearest E2M1 values, ties to the even code, saturating at +-6; -0 keeps its sign."""
    magnitudes = torch.tensor(e2m1_values()[:8], dtype=y.dtype, device=y.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # (7,) 0.25 0.75 1.25 1.75 2.5 3.5 5
    mag = y.abs().contiguous()
    down = torch.bucketize(mag, midpoints, right=False)  # a tie goes to the smaller code
    up = torch.bucketize(mag, midpoints, right=True)  # a tie goes to the larger code
    code = torch.where(down % 2 == 0, down, up)  # the two differ only at a tie, by one: pick the even
    return (code | (torch.signbit(y).long() << 3)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference MXFP4 quantizer written from the OCP spec, for tests and checkpoint conversion.

    Per block of 32 along the last dim: shared exponent X = floor(log2(max |x|)) - 2 (E2M1's emax),
    scale byte X + 127 clamped to [0, 254]; each element x / 2 ** X rounded to the nearest E2M1
    value, ties to the even code (IEEE round-half-to-even on the 1-bit mantissa), saturating at
    +-6. An all-zero block gets scale byte 0 (2 ** -127) and zero codes; -0.0 keeps its sign bit
    (code 8), so every tensor `dequantize_mxfp4` can produce round-trips bit for bit.

    Args:
        w: float (..., cols), cols a multiple of 32, finite.
    Returns:
        (blocks, scales): uint8 (..., cols / 32, 16) and (..., cols / 32), gpt-oss's layout.
    Raises:
        ValueError: cols not a multiple of 32, or non-finite values.
    """
    if w.dim() < 1 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK_SIZE}, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("MXFP4 quantization needs finite weights")
    *prefix, cols = w.shape
    x = w.float().reshape(*prefix, cols // BLOCK_SIZE, BLOCK_SIZE)  # (..., groups, 32)
    amax = x.abs().amax(dim=-1)  # (..., groups)
    # frexp: amax = m * 2 ** e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exact (no log2 rounding)
    _, exponent = torch.frexp(amax)
    shared = exponent.long() - 1 - E2M1_EMAX
    scales = torch.where(amax > 0, shared + E8M0_BIAS, 0).clamp(0, E8M0_NAN - 1).to(torch.uint8)
    y = x / _e8m0_table(w.device)[scales.long()].unsqueeze(-1)  # exact: over a power of two
    codes = _round_to_e2m1(y)  # (..., groups, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (..., groups, 16)
    return blocks.contiguous(), scales
