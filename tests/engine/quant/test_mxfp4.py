"""MXFP4 (gpt-oss expert weights): the E2M1 table, decoding against transformers' decoder, exact
round trips, the spec's rounding, the error on Gaussian weights, and bad input."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.mxfp4 import FP4_VALUES, _convert_moe_packed_tensors

from engine.quant.mxfp4 import BLOCK_SIZE, dequantize_mxfp4, e2m1_values, quantize_mxfp4

# (experts, rows, cols): gpt-oss's gate_up (E, 2I, H) and down (E, H, I) in miniature
SHAPES = [(4, 96, 64), (3, 64, 160)]
# relative RMS error of quantize -> dequantize on Gaussian weights: measured 0.113 on these shapes (0.114 on
# (8, 512, 2880)); the bound is 1.5x that
MAX_GAUSSIAN_REL_RMS = 0.17


def create_exact_packed(shape, seed=0, max_scale_byte=252):
    """Random blocks and scales whose every block holds a +-6 code (so its shared exponent is its
    scale), scale bytes 0..max_scale_byte (6 * 2 ** 125 is the largest block max fp32 holds)."""
    *prefix, cols = shape
    g = torch.Generator().manual_seed(seed)
    num_groups = cols // BLOCK_SIZE
    codes = torch.randint(0, 16, (*prefix, num_groups, BLOCK_SIZE), generator=g, dtype=torch.uint8)
    top = torch.randint(0, BLOCK_SIZE, (*prefix, num_groups, 1), generator=g)
    six = torch.where(torch.rand(*prefix, num_groups, 1, generator=g) < 0.5, 7, 15).to(torch.uint8)  # +6 or -6
    codes.scatter_(-1, top, six)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(0, max_scale_byte + 1, (*prefix, num_groups), generator=g, dtype=torch.uint8)
    return blocks.contiguous(), scales


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, so +0 and -0 (and any NaN) compare as themselves."""
    return t.float().contiguous().view(torch.int32)


def test_e2m1_table_from_bits_equals_transformers():
    """The table derived from E2M1's bit layout is transformers' FP4_VALUES, signs of zero included."""
    ours = e2m1_values()
    assert ours == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert ours == list(FP4_VALUES)
    assert [math.copysign(1, v) for v in ours] == [math.copysign(1, v) for v in FP4_VALUES]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_equals_transformers_bit_for_bit(shape):
    """Our (E, rows, cols) decode is transformers' `_convert_moe_packed_tensors` (which returns
    (E, cols, rows)) transposed back, bit for bit in fp32 and bf16, across all finite scale bytes."""
    blocks, scales = create_exact_packed(shape, seed=1, max_scale_byte=254)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        theirs = _convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert ours.shape == shape and ours.dtype == dtype
        assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows_per_chunk", [None, 7])
def test_exact_weights_round_trip_bit_for_bit(shape, rows_per_chunk):
    """Representable weights round-trip: blocks, scales -> dequantize -> quantize gives back the same
    bytes (+-0 included); the chunked decode and the bf16 decode hold the same numbers as fp32."""
    blocks, scales = create_exact_packed(shape, seed=2)
    w = dequantize_mxfp4(blocks, scales, torch.float32, rows_per_chunk=rows_per_chunk)
    assert torch.isfinite(w).all()
    assert torch.equal(_bits(w), _bits(dequantize_mxfp4(blocks, scales, torch.float32, rows_per_chunk=1)))
    assert torch.equal(_bits(w), _bits(dequantize_mxfp4(blocks, scales, torch.bfloat16)))
    blocks2, scales2 = quantize_mxfp4(w)
    assert torch.equal(scales2, scales)
    assert torch.equal(blocks2, blocks)


def test_quantize_rounds_ties_to_even_code_and_saturates():
    """With block max in [4, 8) the scale is 2 ** 0: midpoints go to the even code, beyond 6 saturates,
    an all-zero block is scale byte 0 with zero codes."""
    row = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -7.5]
    w = torch.tensor([row + [0.0] * 16, [0.0] * 32])
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127], [0]]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0] + [0.0] * 16
    deq = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(_bits(deq), _bits(torch.tensor([expected, [0.0] * 32])))
    assert blocks[1].eq(0).all()


def test_shared_exponent_exact_just_below_a_power_of_two():
    """floor(log2(max)) is exact where an fp32 log2 would round up: a block max just below 2 ** 20
    gets shared exponent 19 - 2 (and saturates to 6 * 2 ** 17 rather than overflowing)."""
    below = torch.nextafter(torch.tensor(2.0 ** 20), torch.tensor(0.0))
    blocks, scales = quantize_mxfp4(torch.cat([below.view(1), torch.zeros(31)]))
    assert scales.tolist() == [127 + 17]
    assert dequantize_mxfp4(blocks, scales, torch.float32)[0].item() == 6 * 2.0 ** 17


def _nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Brute force: the E2M1 value nearest each element of y (the reference for the quantizer)."""
    grid = torch.tensor(e2m1_values())
    return grid[(y.unsqueeze(-1) - grid).abs().argmin(dim=-1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_gaussian_round_trip_error_within_format(shape):
    """On Gaussian weights each block's max lands in [4, 8) times its scale, each element decodes to
    the E2M1 value nearest x / scale (saturating at +-6), so |error| <= half the E2M1 spacing there
    times the scale; the relative RMS error is ~0.1."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * 0.02
    blocks, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(blocks, scales, torch.float32)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(BLOCK_SIZE, dim=-1)  # (E, rows, cols)
    y = w / scale
    block_max = y.abs().view(*shape[:-1], -1, BLOCK_SIZE).amax(dim=-1)
    assert ((block_max >= 4) & (block_max < 8)).all()
    assert torch.equal(deq / scale, _nearest_e2m1(y))

    mag = y.abs()
    half_spacing = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))
    err = (w - deq).abs() / scale
    in_range = mag <= 6
    assert (err[in_range] <= half_spacing[in_range]).all()
    assert torch.equal(deq[~in_range].abs() / scale[~in_range], torch.full_like(deq[~in_range], 6.0))

    rel_rms = ((w - deq).norm() / w.norm()).item()
    assert 0.08 < rel_rms < MAX_GAUSSIAN_REL_RMS, rel_rms


@pytest.mark.parametrize("blocks_shape, scales_shape", [
    ((4, 8, 2, 16), (4, 8, 3)),  # scales' groups disagree
    ((4, 8, 2, 8), (4, 8, 2)),  # 8 bytes a block, not 16
    ((16,), (1,)),  # no group dim
])
def test_bad_shapes_raise(blocks_shape, scales_shape):
    """Mismatched blocks / scales shapes raise ValueError."""
    blocks = torch.zeros(blocks_shape, dtype=torch.uint8)
    scales = torch.full(scales_shape, 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales, torch.float32)


def test_bad_input_raises():
    """NaN scale bytes (255) are counted and rejected; non-uint8 inputs, a last dim that is not a
    multiple of 32, and non-finite weights to quantize raise ValueError."""
    blocks, scales = create_exact_packed((2, 8, 64))
    scales[0, 1, 0] = scales[1, 7, 1] = 255
    with pytest.raises(ValueError, match="2 NaN"):
        dequantize_mxfp4(blocks, scales, torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.tensor([float("inf")] + [0.0] * 31))
