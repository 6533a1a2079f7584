"""The torch attention backend's two decode paths against a plain per-sequence reference: small
batches (SDPA in fp32 over the gathered K/V) and larger ones (the masked bmm), on either side of
SMALL_DECODE_KV, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.torch_backend import SMALL_DECODE_KV, TorchAttentionBackend
from tests.engine.test_flash_backend import _gather_paged, _ref_attend, build_metadata

HEAD_DIM = 64
DECODES = {"batch_1": [(175, 1)], "batch_2_ragged": [(40, 1), (200, 1)], "batch_8": [(255, 1)] * 8,
           "batch_32_ragged": [(20 * i + 3, 1) for i in range(32)]}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", list(DECODES), ids=list(DECODES))
def test_decode_matches_reference(batch, dtype, tol, monkeypatch):
    """Each decode's output equals softmax(q K^T) V over its own context, for 9 query heads on 3
    KV heads (SmolLM2's grouping), whichever path its size takes; the spies show both paths ran
    across the cases (batch 1 and 2 small, 8 and 32 large)."""
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = build_metadata(DECODES[batch], 16, gen)
    heads, kv_heads = 9, 3
    q = torch.randn(meta.num_decodes, heads, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(meta.num_decodes, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, 16, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    small = []
    original = TorchAttentionBackend._small_decode
    monkeypatch.setattr(TorchAttentionBackend, "_small_decode",
                        lambda self, *a: small.append(True) or original(self, *a))
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)
    for i, n in enumerate(meta.seq_lens_cpu):
        ks, vs = _gather_paged(cache[0], meta.block_tables[i], n), _gather_paged(cache[1], meta.block_tables[i], n)
        ref = _ref_attend(q[i:i + 1].float(), ks.float(), vs.float(), HEAD_DIM ** -0.5, True)
        assert (out[i].float() - ref[0]).abs().max() <= tol * max(1.0, ref.abs().max()), (batch, i)
    padded = meta.num_decodes * -(-max(meta.seq_lens_cpu) // 16) * 16
    assert bool(small) == (padded <= SMALL_DECODE_KV) and torch_backend.SMALL_DECODE_KV == 512
