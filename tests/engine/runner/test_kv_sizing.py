"""How many KV blocks a rank gets: fixed, from the CPU budget, or (on a GPU) from the device's
memory after profiling steps (engine/runner/kv_budget.py; its arithmetic: test_kv_device_budget.py). The
profiling steps run on a CPU too: they must leave the runner exactly as they found it; and a CPU
runner given a device reader sizes its pool through the same path as a GPU rank."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.config import CacheConfig
from engine.core.kv_cache import kv_block_bytes
from engine.runner.model_runner import ModelRunner
from tests.engine.runner.fake_gpu import GiB, MiB, FakeGpu
from tests.helpers import all_logits, engine_config, make_hf_tiny_llama, model_config_of, random_prompts


def _runner(hf, device_memory=None, **cache) -> ModelRunner:
    cfg = dataclasses.replace(engine_config(), cache=CacheConfig(**cache))
    return ModelRunner(cfg, model_config=model_config_of(hf), weights=hf.state_dict().items(),
                       device_memory=device_memory)


@pytest.fixture(scope="module")
def hf():
    return make_hf_tiny_llama(seed=3)


def test_fixed_and_cpu_budget_counts(hf):
    assert _runner(hf, num_blocks=37).num_blocks == 37
    mc = model_config_of(hf)
    runner = _runner(hf, memory_gib=0.001)
    assert runner.num_blocks == int(0.001 * 2**30) // kv_block_bytes(mc, mc.num_kv_heads, 16, runner.dtype)
    assert runner.kv_cache.shape[2] == runner.num_blocks


def test_profiling_steps_leave_the_runner_as_it_was(hf):
    """Logits of a prompt through the paged cache are the same before and after the budget's
    profiling steps (a prefill chunk at the end of a context longer than the model's positions,
    clamped; a decode batch at the longest context), the pool is the runner's own again and no
    request is left behind."""
    runner = _runner(hf, num_blocks=64)
    prompt = random_prompts(1, [40], seed=9)[0]
    before = all_logits(runner, prompt, chunk=16)
    pool = runner.kv_cache
    runner.profile_step(1, 256, 10 * hf.config.max_position_embeddings)
    runner.profile_step(8, 1, hf.config.max_position_embeddings)
    assert runner.kv_cache is pool and runner.requests == {}
    assert torch.equal(all_logits(runner, prompt, chunk=16), before)


def test_a_cpu_runner_given_a_device_reader_sizes_its_pool_from_it(hf):
    """The device path on a CPU (as bench/gpu_memory.py's dry run takes it): 2 GiB at 0.5, less a
    1012 MiB context, leaves 12 MiB (the pretend device sees no weights or activations) = 1024 tiny
    blocks of 12 KiB; with a context 8 KiB short of the whole share, one 512-token request (33
    blocks) does not fit: refused at start."""
    mc = model_config_of(hf)
    assert kv_block_bytes(mc, mc.num_kv_heads, 16, torch.float32) == 12 * 1024
    runner = _runner(hf, FakeGpu(2 * GiB, context=1012 * MiB), gpu_memory_utilization=0.5)
    assert runner.num_blocks == runner.kv_cache.shape[2] == 1024 and runner.memory_budget.num_blocks == 1024
    with pytest.raises(ValueError, match="0 blocks of 16 tokens fit, one request at max_model_len 512 needs 33"):
        _runner(hf, FakeGpu(2 * GiB, context=GiB - 8 * 1024), gpu_memory_utilization=0.5)
