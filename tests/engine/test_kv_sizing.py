"""How many KV blocks a rank gets: fixed, from the CPU budget, or (on a GPU) from the device's
memory after a profiling forward. The profiling forward runs on a CPU too: it must leave the
runner exactly as it found it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache import kv_block_bytes
from engine.model_runner import ModelRunner
from tests.helpers import all_logits, engine_config, make_hf_tiny_llama, model_config_of, random_prompts


def _runner(hf, **cache) -> ModelRunner:
    cfg = dataclasses.replace(engine_config(), cache=CacheConfig(**cache))
    return ModelRunner(cfg, model_config=model_config_of(hf), weights=hf.state_dict().items())


@pytest.fixture(scope="module")
def hf():
    return make_hf_tiny_llama(seed=3)


def test_fixed_and_cpu_budget_counts(hf):
    assert _runner(hf, num_blocks=37).num_blocks == 37
    mc = model_config_of(hf)
    runner = _runner(hf, memory_gib=0.001)
    assert runner.num_blocks == int(0.001 * 2**30) // kv_block_bytes(mc, mc.num_kv_heads, 16, runner.dtype)
    assert runner.kv_cache.shape[2] == runner.num_blocks


def test_profiling_forward_leaves_the_runner_as_it_was(hf):
    """Logits of a prompt through the paged cache are the same before and after a profiling
    forward longer than the model's positions (clamped), the pool is the runner's own again and
    no request is left behind."""
    runner = _runner(hf, num_blocks=64)
    prompt = random_prompts(1, [40], seed=9)[0]
    before = all_logits(runner, prompt, chunk=16)
    pool = runner.kv_cache
    runner.profile_forward(10 * hf.config.max_position_embeddings)
    assert runner.kv_cache is pool and runner.requests == {}
    assert torch.equal(all_logits(runner, prompt, chunk=16), before)
