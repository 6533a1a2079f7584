"""The LM head from a GGUF's Q8_0 blocks (engine/quant/q8_head.py): blocks decoded exactly, the two
int4 planes summing exactly to the Q8_0 weights, the planes' kernel against the plain-torch
product, the per-M choice at load, where it applies, and the default GGUF running it."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from engine.loading.loader import resolve_model_path
from engine.quant import create_linear_method
from engine.quant.integer import Int4PackKernel
from engine.quant.q4 import dequantize_q4
from engine.quant.q8_head import (DequantizedQ8Kernel, Q8HeadMethod, Q8Int4PlanesKernel, decode_q8_0_blocks,
                                  dequantize_q8_0, int4_planes, q8_head_method, random_q8_0)

Q8_0 = gguf.GGMLQuantizationType.Q8_0
CPU = torch.device("cpu")
needs_int4pack = pytest.mark.skipif(Int4PackKernel().unavailable(CPU) is not None, reason="no int4pack kernel")


def _q8(shape, seed=0):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).numpy()
    raw = gguf.quants.quantize(w, Q8_0)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, Q8_0).reshape(shape).astype(np.float32))


def test_decoded_blocks_equal_gguf_dequantize_and_the_planes_sum_to_them():
    raw, expected = _q8((64, 96))
    codes, scales = decode_q8_0_blocks(raw, (64, 96))
    assert codes.dtype == torch.int8 and scales.shape == (64, 3) and int(codes.min()) < -100 < 100 < int(codes.max())
    assert torch.equal(dequantize_q8_0(codes, scales, torch.float32), expected)
    (hi, hi_scales, hi_mins), (lo, lo_scales, lo_mins) = int4_planes(codes, scales)
    assert int(hi.max()) <= 15 and int(lo.max()) <= 15
    assert torch.equal(dequantize_q4(hi, hi_scales, hi_mins) + dequantize_q4(lo, lo_scales, lo_mins), expected)


@needs_int4pack
@pytest.mark.parametrize("m", [1, 3])
def test_planes_kernel_within_bf16_rounding_of_the_product(m):
    """bf16: each plane's product rounds once to bf16 before the sum, so within two roundings
    of the exact product; the dense bf16 head rounds its weights instead."""
    raw, weight = _q8((512, 576), seed=1)
    codes, scales = decode_q8_0_blocks(raw, (512, 576))
    x = torch.randn(m, 576).to(torch.bfloat16)
    want = x.float() @ weight.t()
    got = Q8Int4PlanesKernel().run(Q8Int4PlanesKernel().prepare(codes, scales, torch.bfloat16), x)
    dense = DequantizedQ8Kernel().run(DequantizedQ8Kernel().prepare(codes, scales, torch.bfloat16), x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 512)
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2 * 2 ** -8 * scale
    assert (dense.float() - want).abs().max().item() <= 2 * 2 ** -8 * scale
    assert Q8Int4PlanesKernel().unsupported((512, 576), torch.float32) is not None  # no vectorized fp32 int4


@needs_int4pack
def test_the_method_measures_at_load_and_runs_its_choice_per_m():
    codes, scales = random_q8_0((1024, 576), CPU)
    head = Q8HeadMethod(codes, scales, torch.bfloat16)
    layer = SimpleNamespace(weight=torch.empty(1024, 576, dtype=torch.bfloat16))
    head.process_layers([layer])
    assert head.codes is None and {c.kernel for c in head.choices} <= {"q8_0_int4_planes", "dequantized"}
    assert set(layer.quant_state) == {c.kernel for c in head.choices}
    weight = dequantize_q8_0(codes, scales, torch.float32)
    for m in (1, 40):
        x = torch.randn(m, 576).to(torch.bfloat16)
        want = x.float() @ weight.t()
        assert (head.apply(layer, x, None).float() - want).abs().max() <= 2 * 2 ** -8 * want.abs().max()
    assert "Q8_0" in head.describe([layer]) and "M<=1" in head.describe([layer])


def test_it_applies_only_where_the_file_keeps_its_own_blocks_on_a_cpu_in_bf16(caplog):
    path = resolve_model_path("smollm2")
    int4 = create_linear_method("int4", path)
    assert int4.prequantized
    with caplog.at_level("INFO", logger="engine.quant.q8_head"):
        assert q8_head_method(path, create_linear_method("unquantized"), torch.bfloat16, CPU, 1) is None
        assert q8_head_method(path, int4, torch.float32, CPU, 1) is None
        assert q8_head_method(path, int4, torch.bfloat16, CPU, 2) is None
        head = q8_head_method(path, int4, torch.bfloat16, CPU, 1)
    assert isinstance(head, Q8HeadMethod) and head.codes.shape == (49152, 576)
    assert "not float32" in caplog.text and "tensor-parallel" in caplog.text
