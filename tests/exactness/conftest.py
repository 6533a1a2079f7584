"""The exactness matrix's fixtures: one local Ray and one tiny model with a real tokenizer for the
whole package."""
from __future__ import annotations

import json

import pytest

from engine.text.tokenizer import Tokenizer
from tests.helpers import local_ray, save_tiny_llama


@pytest.fixture(scope="package")
def ray_session():
    """One local Ray for the package (tests.helpers.local_ray)."""
    with local_ray():
        yield


@pytest.fixture(scope="package")
def model(tmp_path_factory) -> str:
    """A tiny random Llama whose heads split over 3 ranks (6 query, 3 KV heads), over SmolLM2's
    vocabulary and tokenizer (a structured-output request needs one)."""
    tokenizer = Tokenizer.from_path("smollm2")
    folder = tmp_path_factory.mktemp("exactness") / "tiny"
    save_tiny_llama(folder, seed=5, vocab_size=tokenizer.backend.get_vocab_size(), hidden_size=96,
                    intermediate_size=192, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(folder)
