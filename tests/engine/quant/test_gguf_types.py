"""Every tensor type llama.cpp's quantizer writes (Q2_K to Q8_0, BF16, F16, F32) loads equal to
gguf-py's own dequantization; the 4-bit types that decode onto int4 (Q4_0, Q4_1, Q4_K) run on their
codes where the whole layer has them (engine/quant/gguf_codes.py), the rest dequantized, as a Q4_K_M
mix needs; and the load log names every type."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import torch

from bench.gguf_types import LINEARS, TYPES, q4_k_m_types, random_blocks, write_llama_gguf
from engine.loading.loader import load_weights
from engine.quant.gguf_codes import describe_tensor_types, gguf_code_plan
from engine.quant.gguf_file import _as_hf_rows, hf_param_name, open_gguf
from engine.quant.q4 import decode_q4_blocks, dequantize_q4

# K-quants take rows of 256 weights: every input width is 256
WIDTHS = dict(hidden=256, ffn=256, heads=4, kv_heads=2, vocab=64)


def _gguf_dequantized(path) -> dict[str, torch.Tensor]:
    """Each tensor of the file as gguf-py dequantizes it, under its HF name, rows in HF order."""
    out = {}
    for t in open_gguf(path).tensors:
        name = hf_param_name(t.name, "llama", 3)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[name] = _as_hf_rows(torch.from_numpy(w.reshape(tuple(int(d) for d in reversed(t.shape)))), name,
                                "llama", WIDTHS["heads"], WIDTHS["kv_heads"])
    return out


def test_every_tensor_type_loads_as_gguf_py_dequantizes_it(tmp_path, caplog):
    """A file with one linear of each of the 13 types loads equal to gguf-py's dequantization,
    and the load log counts each type (all dequantized: no layer is all Q4 here)."""
    slots = [f"blk.{i}.{n}" for i in range(2) for n in LINEARS]
    path = write_llama_gguf(tmp_path / "types.gguf", dict(zip(slots, TYPES)), layers=2, **WIDTHS)
    assert {t.tensor_type.name for t in open_gguf(path).tensors} == set(TYPES)
    with caplog.at_level(logging.INFO, logger="engine.quant.gguf_codes"):
        loaded = dict(load_weights(path, torch.float32, cache_dir=tmp_path / "cache"))
    expected = _gguf_dequantized(path)
    assert set(loaded) == set(expected)
    for name, w in loaded.items():
        assert torch.equal(w, expected[name]), name
    logged = next(r.getMessage() for r in caplog.records if "tensor types" in r.getMessage())
    for kind in TYPES:
        assert f"{kind}: " in logged, kind
    assert "int4 codes" not in logged


def test_q4_k_decodes_onto_int4_bit_for_bit():
    """Q4_K super-blocks as codes, scales (d * sc) and mins (-dmin * m) per group of 32, dequantized
    in fp32, equal gguf-py's dequantization exactly; every code and sub-block scale is used."""
    raw = random_blocks("Q4_K", (48, 512), np.random.default_rng(1))
    q, scales, mins = decode_q4_blocks(raw, gguf.GGMLQuantizationType.Q4_K, (48, 512))
    assert q.shape == (48, 512) and scales.shape == mins.shape == (48, 16)
    assert len(q.unique()) == 16 and len(scales[0].unique()) > 8
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(48, 512)
    assert torch.equal(dequantize_q4(q, scales, mins), torch.from_numpy(expected))


def test_q4_k_m_mix_reads_whole_q4_layers_as_codes(tmp_path):
    """In llama.cpp's Q4_K_M mix (3 layers: the last has Q6_K attn_v and ffn_down) the layers all
    Q4_K are codes; qkv_proj and down_proj of the last layer load as floats; every value equals
    gguf-py's dequantization either way."""
    path = write_llama_gguf(tmp_path / "mix.gguf", q4_k_m_types(3), layers=3, **WIDTHS)
    plan = gguf_code_plan(path)
    fused_floats = {"blk.2.attn_q", "blk.2.attn_k", "blk.2.attn_v", "blk.2.ffn_down"}
    assert plan.codes == {f"blk.{i}.{n}.weight" for i in range(3) for n in LINEARS} - {
        f"{n}.weight" for n in fused_floats} and not plan.experts
    assert describe_tensor_types(path, plan) == ("F32: 7 dequantized; Q4_K: 17 int4 codes, 3 dequantized; "
                                                 "Q6_K: 3 dequantized")
    loaded = dict(load_weights(path, torch.float32, cache_dir=tmp_path / "cache", q4_codes=True))
    expected = _gguf_dequantized(path)
    coded = {n.removesuffix(".qweight") for n in loaded if n.endswith(".qweight")}
    assert len(coded) == 17 and "model.layers.2.self_attn.q_proj" not in coded
    for base in coded:
        w = dequantize_q4(loaded[f"{base}.qweight"], loaded[f"{base}.scales"], loaded[f"{base}.mins"])
        assert torch.equal(w, expected[f"{base}.weight"]), base
    floats = {n for n in loaded if not n.endswith((".qweight", ".scales", ".mins"))}
    assert floats == set(expected) - {f"{b}.weight" for b in coded}
    assert all(torch.equal(loaded[n], expected[n]) for n in floats)


def test_q4_k_m_mix_runs_int4_beside_dequantized_layers(tmp_path, monkeypatch):
    """The engine on a Q4_K_M mix under `auto` runs int4 on the Q4_K layers and the dequantized
    floats on the others, with the logits of `none` (everything dequantized) to fp32 rounding."""
    from engine.runner.model_runner import ModelRunner
    from tests.helpers import all_logits, engine_config, random_prompts
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "mix.gguf", q4_k_m_types(3), layers=3, **WIDTHS)
    prompt = random_prompts(1, [24], vocab=WIDTHS["vocab"], seed=5)[0]
    logits = {}
    for quantization in ("none", "auto"):
        runner = ModelRunner(engine_config(model=str(path), quantization=quantization, num_blocks=16))
        logits[quantization] = all_logits(runner, prompt, len(prompt))
        if quantization == "auto":
            assert runner.linear_layers.startswith("int4: int4 group-wise")
            assert "2 layers of other GGUF types dequantized: oneDNN prepacked fp32" in runner.linear_layers
    assert (logits["auto"] - logits["none"]).abs().max() <= 1e-4 * logits["none"].abs().max()
    assert torch.equal(logits["auto"].argmax(-1), logits["none"].argmax(-1))


def test_a_mixture_whose_experts_are_not_all_q4_keeps_them_dequantized(tmp_path, monkeypatch):
    """Qwen3-MoE with Q4_0 linears but Q8_0 ffn_down_exps: the experts of a model hold one format,
    so all of them load as floats and stay so (not quantized again to int4), while attention runs
    on its Q4_0 codes; the logits are those of `none` to fp32 rounding."""
    from pathlib import Path

    from engine.layers.moe import moe_blocks
    from engine.runner.model_runner import ModelRunner
    from tests.engine.gguf.requantize import requantize
    from tests.helpers import all_logits, engine_config, random_prompts
    Q = gguf.GGMLQuantizationType
    src = Path(__file__).parents[1] / "gguf" / "qwen3_moe.gguf"
    path = requantize(src, tmp_path / "mixed-experts.gguf", Q.Q4_0, {"ffn_down_exps": Q.Q8_0})
    plan = gguf_code_plan(path)
    assert not plan.experts and plan.codes and not any("_exps" in n for n in plan.codes)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    prompt = random_prompts(1, [30], vocab=500, seed=3)[0]
    logits = {}
    for quantization in ("none", "auto"):
        runner = ModelRunner(engine_config(model=str(path), quantization=quantization))
        logits[quantization] = all_logits(runner, prompt, 1000)
    assert runner.linear_layers.startswith("int4: int4 group-wise")
    experts = [b.experts for _, b in moe_blocks(runner.model)]
    assert all(e.quant is None and e.w13_qweight is None and e.w13_weight is not None for e in experts)
    torch.testing.assert_close(logits["auto"], logits["none"], atol=1e-4, rtol=1e-4)
