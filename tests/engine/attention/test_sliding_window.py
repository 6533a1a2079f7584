"""Sliding-window and soft-capped attention on every backend against a plain per-sequence
reference: a query at position p sees keys p - W + 1 .. p only, in decodes and in prefill chunks
over cached context longer than the window, and a window wider than the context changes nothing;
soft-capped scores are cap * tanh(score / cap) (Gemma 2), with a window or without."""
from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.vllm_cpu_backend import VllmCpuAttentionBackend, vllm_cpu_unavailable
from tests.engine.attention.test_flash_backend import RecordingFlash, _gather_paged, _ref_attend, build_metadata

HEAD_DIM = 64
# (cached tokens, new tokens): decodes (several windows back), a prefill chunk over cached
# context, a whole prompt of 3 windows, a short one inside the window
STEP = [(100, 1), (37, 1), (3, 1), (61, 24), (0, 70), (0, 9)]
DECODES_8 = [(90 + 7 * i, 1) for i in range(8)]  # bf16 at 8 decodes: the torch backend's masked bmm


def _check(backend, seqs, window, dtype, tol, block_size=16, heads=9, kv_heads=3, softcap=None):
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = build_metadata(seqs, block_size, gen)
    n = sum(meta.query_lens)
    q = torch.randn(n, heads, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(n, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen).to(dtype)  # the context
    backend.prepare(meta)
    q = q * 4  # scores of tens: a cap of 5 changes them
    out = backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5, window=window, softcap=softcap)
    flat_q = torch.split(q, meta.query_lens)
    starts = meta.query_start_loc.tolist()
    keys, values = backend.kv_views(cache)  # by token, whatever the backend's block layout
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[i]
        ks, vs = _gather_paged(keys, table, seq_len), _gather_paged(values, table, seq_len)
        ref = _ref_attend(flat_q[i].float(), ks.float(), vs.float(), HEAD_DIM ** -0.5, True, window, softcap)
        got = out[starts[i]:starts[i + 1]].float()
        assert (got - ref).abs().max() <= tol * max(1.0, ref.abs().max()), (type(backend).__name__, i, window)
    return out


@pytest.mark.parametrize("window", [16, 20, 1000])
def test_torch_backend(window):
    _check(TorchAttentionBackend(), STEP, window, torch.float32, 1e-5)
    _check(TorchAttentionBackend(), DECODES_8, window, torch.bfloat16, 2e-2)


def test_a_window_cuts_what_full_attention_sees():
    """The same step with and without a window differs (the check above can fail), and a window
    past every context equals full attention."""
    full = _check(TorchAttentionBackend(), STEP, None, torch.float32, 1e-5)
    assert not torch.allclose(full, _check(TorchAttentionBackend(), STEP, 20, torch.float32, 1e-5))
    torch.testing.assert_close(full, _check(TorchAttentionBackend(), STEP, 1000, torch.float32, 1e-5))


@pytest.mark.parametrize("window", [16, 20])
def test_flash_attn_window_size(window):
    """flash-attn gets window_size (W - 1, 0) (its fake applies flash-attn's documented meaning)."""
    from engine.attention.flash_backend import FlashAttentionBackend
    fake = RecordingFlash()
    backend = FlashAttentionBackend(varlen_fn=fake.varlen, kvcache_fn=fake.with_kvcache)
    _check(backend, STEP, window, torch.float32, 1e-5, block_size=256)
    assert set(fake.calls) == {"varlen", "kvcache"}


@pytest.mark.skipif(vllm_cpu_unavailable() is not None, reason=f"vllm_cpu: {vllm_cpu_unavailable()}")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [32, 40])
def test_vllm_cpu_backend(window, dtype, tol):
    _check(VllmCpuAttentionBackend(), STEP, window, dtype, tol, block_size=32)


SOFTCAPS = [(None, 5.0), (20, 5.0)]  # (window, softcap)


@pytest.mark.parametrize("window,softcap", SOFTCAPS)
def test_softcap_torch_backend(window, softcap):
    full = _check(TorchAttentionBackend(), STEP, window, torch.float32, 1e-5)
    capped = _check(TorchAttentionBackend(), STEP, window, torch.float32, 1e-5, softcap=softcap)
    assert not torch.allclose(full, capped)
    _check(TorchAttentionBackend(), DECODES_8, window, torch.bfloat16, 2e-2, softcap=softcap)


@pytest.mark.parametrize("window,softcap", SOFTCAPS)
def test_softcap_flash_attn(window, softcap):
    from engine.attention.flash_backend import FlashAttentionBackend
    fake = RecordingFlash()
    backend = FlashAttentionBackend(varlen_fn=fake.varlen, kvcache_fn=fake.with_kvcache)
    _check(backend, STEP, window, torch.float32, 1e-5, block_size=256, softcap=softcap)


@pytest.mark.skipif(vllm_cpu_unavailable() is not None, reason=f"vllm_cpu: {vllm_cpu_unavailable()}")
@pytest.mark.parametrize("window,softcap", [(None, 5.0), (40, 5.0)])
def test_softcap_vllm_cpu_backend(window, softcap):
    _check(VllmCpuAttentionBackend(), STEP, window, torch.float32, 1e-5, block_size=32, softcap=softcap)
