"""GGUF files of Qwen2, Qwen3, Gemma 2, Gemma 3 and the mixtures (Mixtral as llama.cpp writes it, a `llama`
file with experts; Qwen2-MoE with its shared expert; Qwen3-MoE) written by llama.cpp's own
converter (tests/engine/gguf/make_fixtures.py) load as their families and give the logits
transformers gives on the model they were converted from (rebuilt here from the same seed and
switches)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loading.gguf_loader import gguf_model_config
from engine.runner.model_runner import ModelRunner
from tests.engine.gguf.make_fixtures import FAMILIES, VOCAB
from tests.helpers import assert_logits_match_transformers, engine_config, make_hf_tiny, random_prompts

HERE = Path(__file__).parents[1] / "gguf"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_matches_transformers(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    family, switches = FAMILIES[name]
    hf = make_hf_tiny(family, seed=len(name), vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **switches)
    path = HERE / f"{name}.gguf"
    cfg = gguf_model_config(path)
    assert cfg.architecture == family
    runner = ModelRunner(engine_config(model=str(path)))
    embed = dict(runner.model.named_parameters())["embed_tokens.weight"]
    assert torch.equal(embed, hf.model.embed_tokens.weight), (
        "the fixture's weights are not this seed's any more (torch's RNG changed?): rerun make_fixtures.py")
    assert_logits_match_transformers(runner, hf, random_prompts(1, [60], vocab=VOCAB, seed=2)[0], chunks=(1000, 1))
