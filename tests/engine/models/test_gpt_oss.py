"""gpt-oss's checkpoints as OpenAI ships them (engine/models/gpt_oss.py): MXFP4 expert weights
decoded on load give transformers' logits over the same (decoded) weights; what its config asks
for that pdserve does not run is refused by name. Its logits, greedy tokens and TP/EP against
transformers are the "gpt_oss" family of tests/engine/models/test_families.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.loader import hf_model_config
from engine.models import UnsupportedConfig
from engine.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.runner.model_runner import ModelRunner
from tests.helpers import (FAMILIES, assert_logits_match_transformers, engine_config, make_hf_tiny,
                           random_prompts)


def _mxfp4_checkpoint(tmp_path):
    """A tiny gpt-oss whose experts are snapped to MXFP4 values, saved with those experts as
    `*_blocks`/`*_scales` (gpt-oss's layout, (E, out, in) once decoded) and quantization_config
    mxfp4; returns (the HF model over the decoded weights, the folder)."""
    kind, switches = FAMILIES["gpt_oss"]
    hf = make_hf_tiny(kind, seed=11, **switches)
    folder = tmp_path / "gpt_oss_mxfp4"
    hf.save_pretrained(folder, safe_serialization=True)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # (E, out, in) as shipped
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        module, attr = name.removeprefix("model.").rsplit(".", 1)
        decoded = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
        with torch.no_grad():
            getattr(hf.model.get_submodule(module), attr).copy_(decoded)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return hf, folder


def test_mxfp4_experts_load_as_transformers_runs_them_decoded(tmp_path, caplog):
    """The MXFP4 pairs are decoded on load (logged), and the logits at every position equal
    transformers' over the decoded weights, prefilled at once and token by token."""
    hf, folder = _mxfp4_checkpoint(tmp_path)
    with caplog.at_level("INFO", logger="engine.models.gpt_oss"):
        runner = ModelRunner(engine_config(model=str(folder)))
    assert "6 MXFP4 tensors dequantized to float32 on load" in caplog.text  # 3 layers x gate_up, down
    assert_logits_match_transformers(runner, hf, random_prompts(1, [60], seed=4)[0], chunks=(1000, 1))


def test_an_mxfp4_half_without_its_pair_is_refused(tmp_path):
    _, folder = _mxfp4_checkpoint(tmp_path)
    file = folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MXFP4 tensors without their blocks or scales: "
                                         r"\['model.layers.1.mlp.experts.down_proj_blocks'\]"):
        ModelRunner(engine_config(model=str(folder)))


@pytest.mark.parametrize("keys,named", [
    (dict(swiglu_limit=5.0), "swiglu_limit 5.0 (pdserve runs gpt-oss's 7.0)"),
    (dict(layer_types=["chunked_attention"] * 3), "layer_types ['chunked_attention']"),
    (dict(quantization_config={"quant_method": "awq"}), "checkpoint quantized with 'awq'"),
])
def test_what_gpt_oss_configs_ask_for_beyond_it_is_refused(tmp_path, keys, named):
    kind, switches = FAMILIES["gpt_oss"]
    folder = tmp_path / "cfg"
    make_hf_tiny(kind, **switches).config.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **keys}))
    with pytest.raises((UnsupportedConfig, ValueError)) as err:
        hf_model_config(folder)
    assert named in str(err.value), str(err.value)
