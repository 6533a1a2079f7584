"""The model against transformers on tiny random Llamas (GQA), fp32."""
from __future__ import annotations

import pytest
import torch

from engine.runner.model_runner import ModelRunner
from tests.helpers import all_logits, engine_config, make_hf_tiny_llama, model_config_of, random_prompts, save_tiny_llama


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_tiny_llama(seed=1)


def _runner(hf_model, **knobs) -> ModelRunner:
    return ModelRunner(engine_config(**knobs), model_config=model_config_of(hf_model),
                       weights=hf_model.state_dict().items())


@pytest.mark.parametrize("chunk", [1000, 7, 1])
def test_logits_match_transformers(hf_model, chunk):
    """Logits at every position equal HF's, whether the prompt is prefilled at once, in chunks
    over cached context, or token by token (the decode path)."""
    runner = _runner(hf_model)
    prompt = random_prompts(1, [45], seed=3)[0]
    ours = all_logits(runner, prompt, chunk)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_tied_embeddings_and_safetensors_folder(tmp_path):
    """A safetensors folder with tied embeddings loads through the loader and matches HF."""
    folder = save_tiny_llama(tmp_path / "tiny", seed=2, tie_word_embeddings=True)
    from transformers import LlamaForCausalLM
    ref_model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    cfg = engine_config(model=str(folder))
    runner = ModelRunner(cfg)
    assert runner.model_config.tie_word_embeddings
    prompt = random_prompts(1, [20], seed=4)[0]
    ours = all_logits(runner, prompt, 1000)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers():
    """Llama-3.1 style rope scaling gives HF's logits."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = make_hf_tiny_llama(seed=5, rope_parameters={"rope_theta": 10000.0, **scaling})
    cfg = model_config_of(hf)
    from dataclasses import replace
    runner = ModelRunner(engine_config(), model_config=replace(cfg, rope_scaling=scaling),
                         weights=hf.state_dict().items())
    prompt = random_prompts(1, [100], seed=6)[0]
    ours = all_logits(runner, prompt, 1000)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_auto_dtype_follows_native_bf16_support():
    """auto is bf16 on CUDA and on CPUs with native bf16 kernels, float32 on CPUs that emulate it."""
    import torch
    from engine.core.config import cpu_has_native_bf16, resolve_dtype
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    cpu = resolve_dtype("auto", torch.device("cpu"))
    assert cpu == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
