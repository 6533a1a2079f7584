"""FP8 block-quantized weights (engine/quant/fp8_block.py), DeepSeek-V3's checkpoint format: the
reference quantizer's round trip within e4m3's rounding, the pairing of weights with their
scales, and a tiny DeepSeek-V3 checkpoint in fp8 loading to its dequantized twin's logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.quant.fp8_block import FP8, dequantize_fp8_blocks, quantize_fp8_blocks, with_fp8_blocks_dequantized


def test_the_reference_quantizer_round_trips_within_e4m3s_rounding():
    """Every weight within half an e4m3 step of its block's scale (3 mantissa bits: 2^-4 of its
    magnitude, or the subnormal spacing 2^-9 x scale near zero), over partial edge blocks too;
    values already on the grid come back bit for bit; each block's largest magnitude maps to 448."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)[None, :]  # blocks of unlike ranges
    codes, scale = quantize_fp8_blocks(w, (128, 128))
    assert codes.dtype == FP8 and scale.shape == (3, 2)
    back = dequantize_fp8_blocks(codes, scale, (128, 128))
    step = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, step * 2 ** -9) * 1.0001).all()
    assert torch.equal(codes.float().abs().amax(), torch.tensor(448.0))
    relative = ((back - w).norm() / w.norm()).item()
    assert 0 < relative < 0.04, relative  # measured 0.026
    again, again_scale = quantize_fp8_blocks(back, (128, 128))
    assert torch.equal(dequantize_fp8_blocks(again, again_scale, (128, 128)), back)


def test_weights_pair_with_their_scales_in_either_order():
    codes, scale = quantize_fp8_blocks(torch.randn(20, 24), (16, 16))
    want = dequantize_fp8_blocks(codes, scale, (16, 16))
    for stream in ([("a.weight", codes), ("a.weight_scale_inv", scale)], [("a.weight_scale_inv", scale),
                                                                        ("a.weight", codes)]):
        got = dict(with_fp8_blocks_dequantized(stream + [("n.weight", torch.ones(3))], (16, 16), torch.float32))
        assert torch.equal(got["a.weight"], want) and set(got) == {"a.weight", "n.weight"}
    with pytest.raises(ValueError, match="without their scales"):
        list(with_fp8_blocks_dequantized([("a.weight", codes)], (16, 16), torch.float32))
    with pytest.raises(ValueError, match=r"needs scales \(2, 2\)"):
        dequantize_fp8_blocks(codes, scale[:1], (16, 16))


def test_an_fp8_deepseek_v3_checkpoint_loads_to_its_dequantized_twin(tmp_path):
    """Every linear of a tiny V3 (attention's, the experts', the shared and dense MLPs') in e4m3
    with a scale per 16 x 16 block and config.json's quantization_config, against the same weights
    dequantized and saved as floats: the same logits, bit for bit."""
    from engine.core.choices import PrefillForms
    from engine.runner.model_runner import ModelRunner
    from tests.helpers import FAMILIES, all_logits, engine_config, random_prompts, save_tiny
    kind, switches = FAMILIES["deepseek_v3"]
    src = save_tiny(tmp_path / "src", kind, seed=4, **switches)
    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    for folder in (fp8, twin):
        folder.mkdir()
    weights, quantized, floats = load_file(str(src / "model.safetensors")), {}, {}
    linears = ("proj.weight", "proj_with_mqa.weight")
    for name, w in weights.items():
        if name.endswith(linears) and "layernorm" not in name and w.dim() == 2:
            codes, scale = quantize_fp8_blocks(w, (16, 16))
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = codes, scale
            floats[name] = dequantize_fp8_blocks(codes, scale, (16, 16))
        else:
            quantized[name] = floats[name] = w
    assert sum(t.dtype == FP8 for t in quantized.values()) >= 20
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(floats, str(twin / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps(config))
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}}))
    prompt = random_prompts(1, [30], seed=1)[0]
    runners = [ModelRunner(engine_config(model=str(f))) for f in (fp8, twin)]
    for runner in runners:  # one prefill form for both (each runner times its own at load)
        for layer in runner.model.layers:
            layer.self_attn.prefill_forms = PrefillForms.fixed("expanded")
    got, want = (all_logits(runner, prompt, 1000) for runner in runners)
    assert torch.equal(got, want)
