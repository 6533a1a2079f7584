"""FP8 block-quantized weights, as DeepSeek-V3 ships them (config.json `quantization_config`:
`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`).

A linear's weight W (out, in) is stored as `weight`, float8_e4m3fn, and `weight_scale_inv`,
float32 (ceil(out / 128), ceil(in / 128)): one scale per 128 x 128 block (the last row and column
of blocks may be partial), with

    W[i, j] = weight[i, j] * weight_scale_inv[i // 128, j // 128]

(the name is the reference's: the scale the quantizer divided by, which the dequantizer multiplies
by). On a CPU the pairs are dequantized on load into the model's dtype, logged; no kernel here runs
them in fp8 (a GPU one would be DeepGEMM's or vLLM's block-scaled GEMM, not in this build).

`quantize_fp8_blocks` is the reference quantizer written from that definition: per block, the
scale that maps its largest magnitude to e4m3's largest finite value (448), the codes rounded to
nearest even by the cast. The tests hold its round trip within e4m3's rounding.
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = ".weight_scale_inv"


def _expand(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales (rows, cols) -> one per element of a (out, in) weight."""
    return scales.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (out, in) e4m3 codes (or their exact values in a wider float), scale_inv (ceil(out /
    block[0]), ceil(in / block[1])) -> W in `dtype`, computed in float32 (one rounding to dtype)."""
    out_features, in_features = weight.shape
    want = (-(-out_features // block[0]), -(-in_features // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"fp8 weight {tuple(weight.shape)} in blocks of {block} needs scales {want}, "
                         f"not {tuple(scale_inv.shape)}")
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block)).to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: (e4m3 codes (out, in), float32 scale_inv per block)."""
    w = w.float()
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[:w.shape[0], :w.shape[1]] = w
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (w / _expand(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def with_fp8_blocks_dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                                dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each fp8 `X.weight` with its `X.weight_scale_inv` (in either order)
    replaced by X's weight dequantized to `dtype`; logs how many. Raises ValueError for an fp8 weight
    without its scales or scales without their weight."""
    weights_of, scales_of = {}, {}
    count = 0
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in weights_of:
                count += 1
                yield f"{base}.weight", dequantize_fp8_blocks(weights_of.pop(base), tensor, block, dtype)
            else:
                scales_of[base] = tensor
        elif tensor.dtype == FP8 and name.endswith(".weight"):
            base = name.removesuffix(".weight")
            if base in scales_of:
                count += 1
                yield name, dequantize_fp8_blocks(tensor, scales_of.pop(base), block, dtype)
            else:
                weights_of[base] = tensor
        else:
            yield name, tensor
    if weights_of or scales_of:
        raise ValueError(f"fp8 weights without their scales, or scales without their weights: "
                         f"{sorted(weights_of) + sorted(scales_of)}")
    if count:
        logger.info("fp8 block-quantized weights: %d dequantized to %s on load (blocks of %dx%d; no fp8 kernel "
                    "runs them here)", count, str(dtype).removeprefix("torch."), *block)
