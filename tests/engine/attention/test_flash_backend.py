"""FlashAttentionBackend against the torch reference backend.

On CPU the two flash-attn functions are replaced by pure-torch references written from
flash-attn's documented semantics (paged K/V through `block_table`, GQA, causal mask aligned
to the bottom right); the references also assert the calling contract (dtypes, shapes,
cu_seqlens, page size). The `gpu` test runs the real flash-attn.
"""
from __future__ import annotations

import math

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flash_backend import FlashAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

HEAD_DIM = 16


def _ref_attend(q, k, v, scale, causal, window=None, softcap=None):
    """One sequence. q: (q_len, heads, hd); k, v: (k_len, kv_heads, hd). Bottom-right causal, GQA;
    with a window, query i (at position i + k_len - q_len) sees only the `window` keys ending at it;
    with a softcap, scores are softcap * tanh(score / softcap) (Gemma 2)."""
    q_len, heads, _ = q.shape
    k_len, kv_heads, _ = k.shape
    group = heads // kv_heads  # query head h reads KV head h // group
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (heads, q_len, k_len)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        q_pos, k_pos = torch.arange(q_len)[:, None] + (k_len - q_len), torch.arange(k_len)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row gives zeros
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _gather_paged(cache, block_row, length):
    """Positions 0..length-1 of one sequence. cache: (num_blocks, page, kv_heads, hd)."""
    page = cache.shape[1]
    pos = torch.arange(length)
    return cache[block_row.long()[pos // page], pos % page]  # (length, kv_heads, hd)


class RecordingFlash:
    """Pure-torch `flash_attn_varlen_func` / `flash_attn_with_kvcache` that check their inputs."""

    def __init__(self):
        self.calls: list[str] = []

    @staticmethod
    def _check_cache(k_cache, v_cache, block_table, batch):
        assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
        assert k_cache.shape[1] % 256 == 0, "flash-attn paged KV needs a page size multiple of 256"
        assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
        assert block_table.stride(-1) == 1

    @staticmethod
    def _window(window_size) -> int | None:
        """flash-attn's (left, right) keys around a query -> ours (left + 1, its own included)."""
        left, right = window_size
        assert right in (-1, 0) and (left == -1) == (right == -1), window_size
        return None if left == -1 else left + 1

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1), softcap=0.0, **unused):
        self.calls.append("varlen")
        batch = cu_seqlens_q.numel() - 1
        assert q.dim() == 3 and block_table is not None and causal
        self._check_cache(k, v, block_table, batch)
        for cu, max_len in ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k)):
            assert cu.dtype == torch.int32 and cu.shape == (batch + 1,) and cu[0] == 0
            assert isinstance(max_len, int) and max_len == int(cu.diff().max())
        assert cu_seqlens_q[-1] == q.shape[0]
        out = torch.empty_like(q)
        for b in range(batch):
            qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            k_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            kb, vb = _gather_paged(k, block_table[b], k_len), _gather_paged(v, block_table[b], k_len)
            out[qs:qe] = _ref_attend(q[qs:qe], kb, vb, softmax_scale, causal, self._window(window_size), softcap)
        return out

    def with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **unused):
        self.calls.append("kvcache")
        batch, q_len, heads, hd = q.shape
        assert q_len == 1 and causal and block_table is not None
        assert k_cache.shape[2] and heads % k_cache.shape[2] == 0 and k_cache.shape[3] == hd
        self._check_cache(k_cache, v_cache, block_table, batch)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,)
        out = torch.empty_like(q)
        for b in range(batch):
            n = int(cache_seqlens[b])
            kb, vb = _gather_paged(k_cache, block_table[b], n), _gather_paged(v_cache, block_table[b], n)
            out[b] = _ref_attend(q[b], kb, vb, softmax_scale, causal, self._window(window_size), softcap)
        return out


def build_metadata(seqs, block_size, gen, device="cpu"):
    """AttentionMetadata as ModelRunner builds it, for `seqs` = [(num_computed_tokens, query_len)].

    Sequences are reordered decodes first; blocks are drawn at random (non-contiguous) from
    1..num_blocks-1, block 0 being the null block. Returns (meta, num_blocks).
    """
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = 1 + sum(need) + 2
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots = [], []
    for (c, n), nb in zip(seqs, need):
        blocks, pool = pool[:nb], pool[nb:]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max(need)
    query_lens, seq_lens = [n for _, n in seqs], [c + n for c, n in seqs]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        num_decodes=sum(1 for n in query_lens if n == 1), query_lens=query_lens, seq_lens_cpu=seq_lens,
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size)
    return meta, num_blocks


def _run_both(flash, seqs, block_size, heads, kv_heads, dtype=torch.float32, device="cpu", seed=0, window=None):
    """Runs flash and torch backends on identical inputs; returns (flash_out, torch_out, caches)."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = build_metadata(seqs, block_size, gen, device)
    num_tokens = sum(meta.query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q = rand(num_tokens, heads, HEAD_DIM)  # (num_tokens, num_heads, head_dim)
    k, v = rand(num_tokens, kv_heads, HEAD_DIM), rand(num_tokens, kv_heads, HEAD_DIM)
    cache = rand(2, num_blocks, block_size, kv_heads, HEAD_DIM)  # random "cached context" and padding
    flash_cache, torch_cache = cache.clone(), cache.clone()
    ref = TorchAttentionBackend()
    scale = HEAD_DIM ** -0.5
    flash.prepare(meta)
    ref.prepare(meta)
    out_flash = flash.forward(q, k, v, flash_cache, meta, scale, window=window)
    out_ref = ref.forward(q, k, v, torch_cache, meta, scale, window=window)
    return out_flash, out_ref, flash_cache, torch_cache


BATCHES = {
    "decodes_only": [(300, 1), (16, 1), (700, 1), (0, 1)],
    "prefills_only": [(0, 40), (0, 300), (0, 1), (0, 257)],
    "mixed_chunks_over_cached_context": [(255, 1), (900, 1), (256, 50), (100, 200), (0, 30), (600, 7)],
}


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa_8_2"])
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_matches_torch_backend(batch, heads, kv_heads):
    """With reference flash-attn functions, the backend's output and cache equal the torch
    backend's for decode-only, prefill-only and mixed batches (chunks over cached context,
    seq_len > query_len), MHA and GQA, random non-contiguous block tables, block size 256;
    decodes go through with_kvcache, the rest through varlen, each called at most once."""
    rec = RecordingFlash()
    backend = FlashAttentionBackend(varlen_fn=rec.varlen, kvcache_fn=rec.with_kvcache)
    block_size = backend.block_size_for(16)
    seqs = BATCHES[batch]
    out_flash, out_ref, flash_cache, torch_cache = _run_both(backend, seqs, block_size, heads, kv_heads)
    torch.testing.assert_close(out_flash, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flash_cache, torch_cache, atol=0, rtol=0)
    expected = (["kvcache"] if any(n == 1 for _, n in seqs) else []) + \
        (["varlen"] if any(n != 1 for _, n in seqs) else [])
    assert rec.calls == expected


def test_larger_block_size_and_reuse_across_steps():
    """A 512-token block size works too, and prepare() replaces the previous step's plan:
    a second step of decodes only does not call varlen again."""
    rec = RecordingFlash()
    backend = FlashAttentionBackend(varlen_fn=rec.varlen, kvcache_fn=rec.with_kvcache)
    out_flash, out_ref, _, _ = _run_both(backend, BATCHES["mixed_chunks_over_cached_context"], 512, 8, 2)
    torch.testing.assert_close(out_flash, out_ref, atol=1e-5, rtol=1e-5)
    rec.calls.clear()
    out_flash, out_ref, _, _ = _run_both(backend, BATCHES["decodes_only"], 512, 8, 2, seed=1)
    torch.testing.assert_close(out_flash, out_ref, atol=1e-5, rtol=1e-5)
    assert rec.calls == ["kvcache"]


def test_reference_masks_bottom_right():
    """The reference itself follows flash-attn's documented mask: with seqlen_q=2, seqlen_k=5,
    row 0 sees keys 0..3 and row 1 sees all 5 (so the comparisons above test something)."""
    q = torch.zeros(2, 1, 4)  # equal scores: each output is the mean of the visible values
    v = torch.arange(5.0).view(5, 1, 1).expand(5, 1, 4)
    out = _ref_attend(q, torch.zeros(5, 1, 4), v, 1.0, causal=True)
    assert out[0, 0, 0] == pytest.approx(1.5) and out[1, 0, 0] == pytest.approx(2.0)


def test_block_size_rounds_up_to_multiple_of_256(caplog):
    """block_size_for returns the smallest multiple of 256 >= the request, logging a change."""
    backend = FlashAttentionBackend(varlen_fn=RecordingFlash().varlen, kvcache_fn=RecordingFlash().with_kvcache)
    with caplog.at_level("INFO", logger="engine.attention.flash_backend"):
        assert backend.block_size_for(16) == 256
    assert "256" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.attention.flash_backend"):
        assert backend.block_size_for(512) == 512
        assert backend.block_size_for(300) == 512
    assert caplog.text.count("rounded up") == 1


def test_backends_without_sinks_refuse_them():
    """flash-attn 2, FlashAttention-3 and the batch-invariant attention have no attention sinks
    (`takes_sinks` False): given sinks, forward raises ValueError naming the backend, before the
    cache is written; given none, it runs."""
    from engine.attention.batch_invariant_backend import BatchInvariantAttentionBackend
    from engine.attention.flash3_backend import Flash3FP8Backend
    flash = RecordingFlash()
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = build_metadata([(5, 1), (0, 7)], 256, gen)
    q, k, v = torch.randn(8, 4, HEAD_DIM), torch.randn(8, 2, HEAD_DIM), torch.randn(8, 2, HEAD_DIM)
    backends = [FlashAttentionBackend(varlen_fn=flash.varlen, kvcache_fn=flash.with_kvcache),
                Flash3FP8Backend(kvcache_fn=lambda *a, **kw: pytest.fail("FA3 called")),
                BatchInvariantAttentionBackend()]
    for backend in backends:
        assert not backend.takes_sinks
        cache = torch.zeros(2, num_blocks, 256, 2, HEAD_DIM)
        backend.prepare(meta)
        with pytest.raises(ValueError, match=f"attention backend {backend.name} cannot take attention sinks"):
            backend.forward(q, k, v, cache, meta, 0.25, sinks=torch.zeros(4))
        assert not cache.any()
    backends[0].forward(q, k, v, cache, meta, 0.25, sinks=None)


def test_missing_flash_attn_raises_clear_import_error():
    """Without flash-attn the module imports, but the backend cannot be built: ImportError names flash-attn."""
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="flash-attn"):
        FlashAttentionBackend()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_real_flash_attn_matches_torch_backend(heads, kv_heads):
    """On CUDA, the real flash-attn kernels agree with the torch backend (fp16) on a mixed batch."""
    pytest.importorskip("flash_attn")
    backend = FlashAttentionBackend()
    out_flash, out_ref, flash_cache, torch_cache = _run_both(
        backend, BATCHES["mixed_chunks_over_cached_context"], backend.block_size_for(16), heads, kv_heads,
        dtype=torch.float16, device="cuda")
    torch.testing.assert_close(out_flash, out_ref, atol=2e-3 * math.sqrt(HEAD_DIM), rtol=1e-2)
    torch.testing.assert_close(flash_cache, torch_cache, atol=0, rtol=0)
