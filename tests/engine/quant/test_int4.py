"""The int4 linear method: GGUF Q4 blocks decoded exactly, its kernels against the plain-torch
reference, and the default GGUF running on its own Q4_1 weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.core.config import ModelConfig
from engine.loading.loader import load_weights, resolve_model_path
from engine.quant import create_linear_method, int4_misfit, resolve_quantization
from engine.quant.integer import DequantizedKernel, Int4PackKernel, ReferenceInt4Kernel
from engine.quant.q4 import GROUP_SIZE, decode_q4_blocks, dequantize_q4, quantize_q4_1

Q4_0, Q4_1 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1
SHAPES = [(960, 576), (576, 1536), (48, 64)]


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", [Q4_0, Q4_1])
def test_decoded_blocks_equal_gguf_dequantize_bit_for_bit(kind):
    """Codes, scales and mins decoded from Q4_0 / Q4_1 blocks, dequantized in fp32, equal
    `gguf.quants.dequantize` of the same blocks exactly; codes stay in 0..15 and both nibbles of
    each byte are used (codes of both halves of a block vary)."""
    w = _weight((64, 96)).numpy()
    raw = gguf.quants.quantize(w, kind)
    q, scales, mins = decode_q4_blocks(raw, kind, w.shape)
    assert q.dtype == torch.uint8 and q.shape == (64, 96) and scales.shape == mins.shape == (64, 96 // GROUP_SIZE)
    assert int(q.max()) <= 15 and len(q[:, :16].unique()) > 8 and len(q[:, 16:32].unique()) > 8
    expected = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(w.shape).astype(np.float32))
    assert torch.equal(dequantize_q4(q, scales, mins), expected)


def test_quantize_q4_1_is_llama_cpp_q4_1_within_half_a_step():
    """A float weight quantized at load is gguf's Q4_1 of it: every weight within half its group's
    step (plus fp16 rounding of the scale and min) of the original."""
    w = _weight((32, 128))
    q, scales, mins = quantize_q4_1(w)
    back = dequantize_q4(q, scales, mins)
    steps = scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert ((back - w).abs() <= steps * 0.5 + 2e-4).all()
    raw = gguf.quants.quantize(w.numpy(), Q4_1)
    assert torch.equal(back, torch.from_numpy(gguf.quants.dequantize(raw, Q4_1).reshape(w.shape)))


@pytest.mark.skipif(Int4PackKernel().unavailable(torch.device("cpu")) is not None, reason="no int4pack kernel")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_int4pack_matches_reference(shape, m):
    """torch's `_weight_int4pack_mm_for_cpu` equals the plain-torch reference on the same codes,
    scales and mins: to fp32 rounding in fp32 (its zero is min + 8 scale), to bf16 rounding in
    bf16 (also from a misaligned view of the input); it refuses out_features not a multiple of 16."""
    weights = quantize_q4_1(_weight(shape))
    x = torch.randn(m, shape[1]) + 0.3
    ref = ReferenceInt4Kernel().run(weights, x)
    kernel = Int4PackKernel()
    assert kernel.unsupported(shape, torch.bfloat16) is None
    assert _rel(kernel.run(kernel.prepare(*weights, torch.float32), x), ref) < 1e-5
    state = kernel.prepare(*weights, torch.bfloat16)
    assert _rel(kernel.run(state, x.bfloat16()), ref) < 1e-2
    misaligned = torch.cat([torch.zeros(m, 1), x], dim=1).bfloat16()[:, 1:]
    assert _rel(kernel.run(state, misaligned), ref) < 1e-2
    assert "multiple of 16" in kernel.unsupported((40, 64), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_kernel_matches_reference(dtype):
    """Dequantized once at load (oneDNN-packed on a CPU) equals dequantizing on every call: to
    accumulation-order rounding in fp32 (1e-6), to bf16 rounding in bf16."""
    weights = quantize_q4_1(_weight((960, 576)))
    x = (torch.randn(5, 576) + 0.3).to(dtype)
    kernel = DequantizedKernel()
    out, ref = kernel.run(kernel.prepare(*weights, dtype), x), ReferenceInt4Kernel().run(weights, x)
    if dtype == torch.float32:
        assert _rel(out, ref) < 1e-6
    else:
        assert _rel(out, ref) < 1e-2


def test_default_gguf_codes_equal_its_dequantized_weights():
    """Every decoder linear of the default GGUF (all Q4_1) read as codes dequantizes to exactly the
    float weights the unquantized path loads (same names, q/k rows unpermuted alike); the other
    tensors are the same either way."""
    path = resolve_model_path("smollm2")
    floats = dict(load_weights(path, torch.float32))
    codes = dict(load_weights(path, torch.float32, q4_codes=True))
    linears = {n.removesuffix(".qweight") for n in codes if n.endswith(".qweight")}
    assert len(linears) == 7 * 30
    for base in linears:
        w = dequantize_q4(codes[f"{base}.qweight"], codes[f"{base}.scales"], codes[f"{base}.mins"])
        assert torch.equal(w, floats[f"{base}.weight"]), base
    rest = {n for n in codes if not n.endswith((".qweight", ".scales", ".mins"))}
    assert rest == set(floats) - {f"{b}.weight" for b in linears}
    assert all(torch.equal(codes[n], floats[n]) for n in rest)


def test_auto_runs_a_q4_gguf_as_int4_unless_its_groups_do_not_fit():
    """auto keeps a Q4_1 GGUF's format (int4, reading its codes) where the groups of 32 fit the TP
    shards; at tp=4 SmolLM2's attention output (576 / 4 = 144) does not fit: auto falls back to
    unquantized, an explicit int4 is refused naming it. A float checkpoint stays unquantized."""
    from engine.loading.loader import load_model_config
    path = resolve_model_path("smollm2")
    config = load_model_config(path)
    assert resolve_quantization("auto", path, config, 1) == "int4"
    assert resolve_quantization("auto", path, config, 2) == "int4"
    assert create_linear_method("int4", path).prequantized
    assert not create_linear_method("int4", None).prequantized
    assert "attention output / tensor_parallel_size 4 = 144" in int4_misfit(config, 4)
    assert resolve_quantization("auto", path, config, 4) == "unquantized"
    with pytest.raises(ValueError, match="quantization int4: attention output"):
        resolve_quantization("int4", path, config, 4)
    assert resolve_quantization("auto", "model-folder", config, 1) == "unquantized"
    tiny = ModelConfig(vocab_size=256, hidden_size=40, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=10)
    assert "hidden_size = 40" in int4_misfit(tiny)


def test_int4_misfit_checks_a_mixtures_experts():
    """The experts are quantized too: each rank's expert width (whole under expert parallelism) and
    the shared expert's must be multiples of 32."""
    from engine.core.config import MoEConfig
    def config(shared: int) -> ModelConfig:
        moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=64, renormalize=True,
                        shared_expert_intermediate_size=shared)
        return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
                           num_kv_heads=4, head_dim=16, moe=moe)
    assert int4_misfit(config(128), 1) is None and int4_misfit(config(128), 2) is None
    assert "expert intermediate_size / tensor_parallel_size 4 = 16" in int4_misfit(config(128), 4)
    assert int4_misfit(config(128), 4, expert_parallel=True) is None  # whole experts
    assert "shared expert intermediate_size / tensor_parallel_size 2 = 48" in int4_misfit(config(96), 2, True)


def test_default_gguf_in_fp32_runs_int4_with_the_unquantized_numbers():
    """The default model under `auto` (int4 from its Q4_1 codes) in fp32 gives the logits of
    `none` (the GGUF dequantized at load) over a 40-token prompt, to fp32 accumulation rounding:
    the same weights, whichever kernel the measurement picked per range."""
    from engine.runner.model_runner import ModelRunner
    from tests.helpers import all_logits, engine_config, random_prompts
    prompt = random_prompts(1, [40], vocab=40000, seed=3)[0]
    logits = {}
    for quantization in ("none", "auto"):
        runner = ModelRunner(engine_config(dtype="float32", quantization=quantization, num_blocks=16))
        assert runner.linear_layers.startswith("int4" if quantization == "auto" else "oneDNN prepacked fp32")
        logits[quantization] = all_logits(runner, prompt, len(prompt))
    assert (logits["auto"] - logits["none"]).abs().max() <= 1e-3
    assert torch.equal(logits["auto"].argmax(-1), logits["none"].argmax(-1))
