"""The fp8 KV cache (`--kv-cache-dtype fp8_e4m3`) at the kernel level: what write_kv stores and
gather_kv reads back against plain-torch e4m3 quantization; the torch backend over an fp8 cache
against the same backend over a full-precision cache holding the round-tripped values; which
backend reads fp8 (FlashAttention-3 through a stand-in; refusals); bytes per block."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.attention import create_attention_backend
from engine.attention.base import FP8, dequantize_fp8, gather_kv, quantize_fp8, write_kv
from engine.attention.flash3_backend import Flash3FP8Backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.config import CacheConfig, resolve_kv_cache_dtype
from engine.core.kv_cache import kv_block_bytes
from engine.runner.model_runner import ModelRunner
from tests.engine.attention.test_flash_backend import (BATCHES, HEAD_DIM, RecordingFlash, _gather_paged, _ref_attend,
                                             build_metadata)
from tests.helpers import engine_config, make_hf_tiny_llama, model_config_of

E4M3_REL_ERR = 2.0 ** -4  # round to nearest with 3 mantissa bits: half a unit in the last place
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # below 2^-6, e4m3 has a fixed step


def _reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain torch: x / scale in fp32, saturated to e4m3's +-448, cast, cast back, times scale."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return dequantize_fp8(quantize_fp8(x, scale), x.dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.25, 8.0, 0.3])
def test_write_then_read_equals_reference_quantization(dtype, scale):
    """write_kv into an fp8 cache, then gather_kv, gives exactly plain-torch e4m3 quantization with
    the scale (x / scale, saturated at +-448, times scale); within e4m3's error of x where x / scale
    is in range (2^-4 relative, 2^-10 x scale absolute below 2^-6); values past 448 x scale
    saturate; other slots stay 0."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads = 6, 4, 2
    k = (torch.randn(9, heads, HEAD_DIM, generator=gen) * 30).to(dtype)
    v = (torch.randn(9, heads, HEAD_DIM, generator=gen) * 0.05).to(dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448 * scale * 1.5, 1e-5])  # saturated, and subnormal
    cache = torch.zeros(2, num_blocks, block_size, heads, HEAD_DIM, dtype=FP8)
    slots = torch.tensor([5, 6, 7, 20, 21, 3, 12, 13, 14])
    write_kv(cache, k, v, slots, k_scale=scale, v_scale=scale)
    flat = cache.view(2, -1, heads, HEAD_DIM)
    got_k, got_v = gather_kv(flat[0], slots, dtype, scale), gather_kv(flat[1], slots, dtype, scale)
    assert got_k.dtype == dtype
    assert torch.equal(got_k, _reference(k, scale)) and torch.equal(got_v, _reference(v, scale))
    assert torch.equal(got_k[0, 0, :3], torch.tensor([448.0, -448.0, 448.0], dtype=dtype) * scale)
    for x, got in ((k, got_k), (v, got_v)):  # in range: 2^-4 relative, or half the subnormal step 2^-9
        x, got = x.float(), got.float()
        in_range = (x / scale).abs() <= 448
        bound = torch.maximum(x.abs() * E4M3_REL_ERR, torch.tensor(E4M3_SUBNORMAL_STEP / 2 * scale))
        slack = x.abs() * torch.finfo(dtype).eps  # the product fp8 x scale is rounded once to `dtype`
        assert ((got - x).abs() <= bound + slack)[in_range].all()
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat.view(torch.uint8)[:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.3, 8.0])
def test_dequantize_equals_the_plain_cast_for_every_fp8_value(dtype, scale):
    """dequantize_fp8's CPU path (the fp8 bits moved into an fp16) equals torch's own cast times the
    scale for all 254 finite e4m3 values: signs, zeros, subnormals, 448."""
    codes = torch.arange(256, dtype=torch.uint8)
    x = codes[(codes & 0x7F) != 0x7F].view(FP8)  # drop the two NaNs
    assert torch.equal(dequantize_fp8(x, dtype, scale), x.to(dtype) * scale)


@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_torch_backend_over_fp8_equals_full_precision_over_round_tripped_kv(batch):
    """The torch backend over an fp8 cache (decodes, prefills, chunks over cached context; GQA;
    scales 0.5 and 2) gives the full-precision backend's output over a cache that holds the same
    K/V rounded through e4m3: quantized on write, dequantized on read, and nothing else changes."""
    gen = torch.Generator().manual_seed(1)
    meta, num_blocks = build_metadata(BATCHES[batch], 16, gen)
    n, heads, kv_heads, k_scale, v_scale = sum(meta.query_lens), 8, 2, 0.5, 2.0
    q = torch.randn(n, heads, HEAD_DIM, generator=gen)
    k, v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen), torch.randn(n, kv_heads, HEAD_DIM, generator=gen)
    context = torch.randn(2, num_blocks, 16, kv_heads, HEAD_DIM, generator=gen)  # cached context and padding
    cache8 = torch.stack([quantize_fp8(context[0], k_scale), quantize_fp8(context[1], v_scale)])
    ref_cache = torch.stack([dequantize_fp8(cache8[0], torch.float32, k_scale),
                             dequantize_fp8(cache8[1], torch.float32, v_scale)])
    fp8, ref = TorchAttentionBackend(), TorchAttentionBackend()
    fp8.prepare(meta)
    ref.prepare(meta)
    out = fp8.forward(q, k, v, cache8, meta, HEAD_DIM ** -0.5, k_scale, v_scale)
    want = ref.forward(q, _round_trip(k, k_scale), _round_trip(v, v_scale), ref_cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack([dequantize_fp8(cache8[0], torch.float32, k_scale),
                                            dequantize_fp8(cache8[1], torch.float32, v_scale)]), ref_cache,
                               atol=0, rtol=0)


class RecordingFA3:
    """Pure-torch `flash_attn_interface.flash_attn_with_kvcache` (FA3's fp8 path, as documented:
    varlen q over a paged cache, e4m3 q/k/v with float32 descales per (sequence, KV head), bf16 out)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k_cache, v_cache, cache_seqlens=None, page_table=None, cu_seqlens_q=None,
                 max_seqlen_q=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                 causal=False, window_size=(-1, -1), softcap=0.0, **unused):
        self.calls += 1
        batch, kv_heads = cu_seqlens_q.numel() - 1, k_cache.shape[2]
        assert not unused and causal and q.dtype == k_cache.dtype == v_cache.dtype == FP8 and q.dim() == 3
        assert page_table.dtype == cache_seqlens.dtype == cu_seqlens_q.dtype == torch.int32
        assert max_seqlen_q == int(cu_seqlens_q.diff().max()) and cu_seqlens_q[-1] == q.shape[0]
        assert all(d.dtype == torch.float32 and d.shape == (batch, kv_heads) for d in (q_descale, k_descale, v_descale))
        group = q.shape[1] // kv_heads
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        for b in range(batch):
            qs, qe, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cache_seqlens[b])
            kb = _gather_paged(k_cache, page_table[b], n).float() * k_descale[b][None, :, None]
            vb = _gather_paged(v_cache, page_table[b], n).float() * v_descale[b][None, :, None]
            qb = q[qs:qe].float() * q_descale[b].repeat_interleave(group)[None, :, None]
            window = RecordingFlash._window(window_size)
            out[qs:qe] = _ref_attend(qb, kb, vb, softmax_scale, causal, window, softcap).to(torch.bfloat16)
        return out


def test_flash3_fp8_backend_matches_torch_backend_through_a_stand_in():
    """With a reference FA3 function, the FlashAttention-3 fp8 backend makes one call per step
    (decodes and chunks over cached context together) and gives the torch backend's output over
    the same fp8 cache (q rounded through e4m3, as FA3's fp8 kernels take it; bf16 output), and
    writes the same bytes."""
    gen = torch.Generator().manual_seed(2)
    meta, num_blocks = build_metadata(BATCHES["mixed_chunks_over_cached_context"], 16, gen)
    n, heads, kv_heads, k_scale, v_scale = sum(meta.query_lens), 8, 2, 0.5, 2.0
    q = torch.randn(n, heads, HEAD_DIM, generator=gen)
    k, v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen), torch.randn(n, kv_heads, HEAD_DIM, generator=gen)
    cache = quantize_fp8(torch.randn(2, num_blocks, 16, kv_heads, HEAD_DIM, generator=gen), 1.0)
    fa3_cache, torch_cache = cache.clone(), cache.clone()
    rec, ref = RecordingFA3(), TorchAttentionBackend()
    fa3 = Flash3FP8Backend(kvcache_fn=rec)
    assert fa3.block_size_for(16) == 16  # FA3 pages may be any size
    for backend in (fa3, ref):
        backend.prepare(meta)
    out = fa3.forward(q, k, v, fa3_cache, meta, HEAD_DIM ** -0.5, k_scale, v_scale)
    want = ref.forward(_round_trip(q, 1.0), k, v, torch_cache, meta, HEAD_DIM ** -0.5, k_scale, v_scale)
    assert rec.calls == 1 and out.dtype == q.dtype
    torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)  # bf16 output: 2^-8 relative
    assert torch.equal(fa3_cache.view(torch.uint8), torch_cache.view(torch.uint8))


def test_backend_choice_with_an_fp8_cache(caplog):
    """fp8 KV: auto picks torch where vllm_cpu cannot read it (here: head_dim 16) and logs why
    (tests/engine/attention/test_vllm_cpu_backend.py: where it can); torch is torch; flash_attn without
    FlashAttention-3 on a Hopper GPU is refused in one line that names what is missing and what
    to use instead."""
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        assert create_attention_backend("auto", cpu, torch.float32, FP8, 16).name == "torch"
    assert "fp8 KV cache: dequantized on read; vllm_cpu cannot run" in caplog.text
    assert create_attention_backend("torch", cpu, torch.bfloat16, FP8).name == "torch"
    with pytest.raises(ValueError, match=r"flash_attn cannot read an fp8_e4m3 KV cache: no CUDA device .*"
                                         r"--attention-backend torch") as err:
        create_attention_backend("flash_attn", cpu, torch.bfloat16, FP8)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_fp8_pool_takes_one_byte_per_element():
    """A block of fp8 KV takes a quarter of fp32's bytes and half of bf16's; from the same CPU budget
    an fp8 runner gets 4x the blocks of an fp32 one, in a float8_e4m3fn pool."""
    hf = make_hf_tiny_llama(seed=3)
    mc = model_config_of(hf)
    fp8 = kv_block_bytes(mc, mc.num_kv_heads, 16, FP8)
    assert fp8 == mc.num_layers * 2 * 16 * mc.num_kv_heads * mc.head_dim
    assert 4 * fp8 == kv_block_bytes(mc, mc.num_kv_heads, 16, torch.float32)
    assert 2 * fp8 == kv_block_bytes(mc, mc.num_kv_heads, 16, torch.bfloat16)
    runners = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        cfg = dataclasses.replace(engine_config(), cache=CacheConfig(memory_gib=0.002, kv_cache_dtype=kv_dtype))
        runners[kv_dtype] = ModelRunner(cfg, model_config=mc, weights=hf.state_dict().items())
    assert runners["fp8_e4m3"].kv_cache.dtype == FP8 and runners["auto"].kv_cache.dtype == torch.float32
    budget = int(0.002 * 2**30)
    assert (runners["fp8_e4m3"].num_blocks, runners["auto"].num_blocks) == (budget // fp8, budget // (4 * fp8))
    assert runners["fp8_e4m3"].kv_cache.nbytes == runners["fp8_e4m3"].num_blocks * fp8
