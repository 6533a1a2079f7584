"""The torch attention backend's two decode paths (fp32 SDPA over the gathered K/V; for larger bf16
batches the masked bmm over a padded batch) against a plain per-sequence reference, at batch
sizes 1 to 32 with ragged contexts, in fp32 and bf16; and the padding that bounds the shapes.
Attention sinks (gpt-oss) against a reference written from their definition, over a mixed step."""
from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import BMM_MIN_BATCH, BMM_MIN_KV, TorchAttentionBackend
from tests.engine.attention.test_flash_backend import _gather_paged, _ref_attend, build_metadata

HEAD_DIM = 64
DECODES = {"batch_1": [(175, 1)], "batch_1_long": [(1000, 1)], "batch_2_ragged": [(40, 1), (600, 1)],
           "batch_8": [(255, 1)] * 8,
           "batch_32_ragged": [(20 * i + 3, 1) for i in range(32)]}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", list(DECODES), ids=list(DECODES))
def test_decode_matches_reference(batch, dtype, tol, monkeypatch):
    """Each decode's output equals softmax(q K^T) V over its own context (padding past it
    ignored), for 9 query heads on 3 KV heads (SmolLM2's grouping); the spy shows which path ran:
    the masked bmm exactly for bf16 batches of BMM_MIN_BATCH or more over BMM_MIN_KV gathered
    positions (8 and 32 here; not 1 or 2 sequences however long, which it would pad to 8 rows)."""
    bmm = []
    original = TorchAttentionBackend._masked_bmm
    monkeypatch.setattr(TorchAttentionBackend, "_masked_bmm", lambda self, *a: bmm.append(1) or original(self, *a))
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = build_metadata(DECODES[batch], 16, gen)
    heads, kv_heads = 9, 3
    q = torch.randn(meta.num_decodes, heads, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(meta.num_decodes, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, 16, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(meta.seq_lens_cpu):
        ks, vs = _gather_paged(cache[0], meta.block_tables[i], n), _gather_paged(cache[1], meta.block_tables[i], n)
        ref = _ref_attend(q[i:i + 1].float(), ks.float(), vs.float(), HEAD_DIM ** -0.5, True)
        assert (out[i].float() - ref[0]).abs().max() <= tol * max(1.0, ref.abs().max()), (batch, i)
    gathered = meta.num_decodes * -(-max(meta.seq_lens_cpu) // 16) * 16
    want = dtype == torch.bfloat16 and meta.num_decodes >= BMM_MIN_BATCH and gathered > BMM_MIN_KV
    assert bool(bmm) == want, (batch, gathered)


def test_masked_bmm_shapes_are_bucketed():
    """The masked bmm's padded batch is a multiple of 8 and its context a multiple of 64 positions
    up to 512, a power of two beyond, whatever the step's exact shape: over batches of 1-64
    sequences and contexts of 1-64 blocks of 16, at most 8 x 10 distinct shapes."""
    shapes = set()
    gen = torch.Generator().manual_seed(0)
    for nd in (1, 3, 8, 9, 17, 33, 64):
        for blocks in (1, 5, 16, 17, 33, 64):
            meta, _ = build_metadata([(blocks * 16 - 1, 1)] * nd, 16, gen)
            backend = TorchAttentionBackend()
            backend.prepare(meta)
            ids, bias = backend._padded_plan(None)
            rows, ctx = bias.shape[0], bias.shape[-1]
            assert rows % 8 == 0 and rows >= nd and ctx >= blocks * 16
            assert ctx % 64 == 0 if ctx <= 512 else ctx & (ctx - 1) == 0
            assert ids.numel() * 16 == rows * ctx and torch.isinf(bias[:nd]).any(-1).all() == (ctx > blocks * 16)
            shapes.add((rows, ctx))
    assert len(shapes) <= 8 * 10


@pytest.mark.parametrize("knobs", [dict(), dict(window=40), dict(softcap=5.0)], ids=["causal", "window", "softcap"])
def test_decode_attends_each_kv_heads_group_without_repeating_it(knobs, monkeypatch):
    """Decode views each KV head's 3 query heads as one query's rows (on a GPU; here the CPU is
    named a grouping device): every SDPA call and every score product sees as many query heads
    as KV heads, so no kernel repeats K/V per query head (SDPA's GQA under a mask takes the math
    kernel, which does; at an 8B shape that was GiBs per layer). The outputs still equal a
    float64 reference, with a window and with soft-capping."""
    from engine.attention import torch_backend
    from tests.engine.quant.test_batch_invariant import reference_attention
    monkeypatch.setattr(TorchAttentionBackend, "GROUPED_DECODE_DEVICES", ("cpu",))
    heads_seen = []
    sdpa, matmul = torch_backend.F.scaled_dot_product_attention, torch.Tensor.__matmul__
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: heads_seen.append((q.shape[1], k.shape[1])) or sdpa(q, k, v, **kw))
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: heads_seen.append((a.shape[1], b.shape[1])) or matmul(a, b))
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **kw: pytest.fail("K/V repeated"))
    gen = torch.Generator().manual_seed(2)
    meta, num_blocks = build_metadata([(90, 1), (30, 1), (140, 1)], 16, gen)
    q = torch.randn(3, 9, HEAD_DIM, generator=gen)
    k, v = (torch.randn(3, 3, HEAD_DIM, generator=gen) for _ in range(2))
    cache = torch.randn(2, num_blocks, 16, 3, HEAD_DIM, generator=gen)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5, **knobs)
    monkeypatch.undo()
    assert heads_seen and all(qh == kh for qh, kh in heads_seen), heads_seen
    for i, n in enumerate(meta.seq_lens_cpu):
        ks, vs = _gather_paged(cache[0], meta.block_tables[i], n), _gather_paged(cache[1], meta.block_tables[i], n)
        ref = reference_attention(q[i:i + 1], ks, vs, HEAD_DIM ** -0.5, **knobs)
        assert (out[i] - ref[0]).abs().max() < 1e-5, i


# -- attention sinks (gpt-oss) ------------------------------------------------------------------

SINK_HEADS, SINK_KV_HEADS = 8, 2  # GQA: 4 query heads on each KV head, each with its own sink
# (cached tokens, new tokens): decodes, a prefill, prefill chunks over cached context
SINK_STEP = [(100, 1), (37, 1), (0, 1), (0, 70), (61, 24), (130, 7)]
SINK_KNOBS = [dict(), dict(window=40), dict(softcap=5.0), dict(softcap=5.0, window=40)]
SINK_IDS = ["causal", "window", "softcap", "softcap_window"]


def sink_step(seqs=SINK_STEP, heads=SINK_HEADS, kv_heads=SINK_KV_HEADS, head_dim=HEAD_DIM, block_size=16,
              dtype=torch.float32, seed=0):
    """A step's metadata, q/k/v, a random cache (the cached context) and (heads,) float32 sinks of
    -1..7, so that some heads' sinks take most of the weight and others' almost none."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = build_metadata(seqs, block_size, gen)
    n = sum(meta.query_lens)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    sinks = torch.rand(heads, generator=gen) * 8 - 1
    return meta, q, k, v, cache, sinks


def sink_reference(q, k, v, scale, sinks, window=None, softcap=None):
    """One sequence's attention with sinks from the definition, in float64: scores q k * scale,
    soft-capped, masked (causal from position seq_len - q_len, the window), each head's sink
    logit appended as one more column, softmax, the column dropped (a sink has no value).
    q: (q_len, heads, hd); k, v: (seq_len, kv_heads, hd); sinks: (heads,) -> (q_len, heads, hd)."""
    q_len, heads, _ = q.shape
    length = k.shape[0]
    group = heads // k.shape[1]  # query head h reads KV head h // group
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # (heads, q_len, seq_len)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos, k_pos = torch.arange(length - q_len, length)[:, None], torch.arange(length)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = sinks.double()[:, None, None].expand(heads, q_len, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _assert_sinks_match_reference(out, q, cache, meta, sinks, tol, **knobs):
    """Each sequence's rows of `out` against `sink_reference` over its context as `cache` holds it."""
    starts = meta.query_start_loc.tolist()
    for i, n in enumerate(meta.seq_lens_cpu):
        s, e = starts[i], starts[i + 1]
        ks, vs = _gather_paged(cache[0], meta.block_tables[i], n), _gather_paged(cache[1], meta.block_tables[i], n)
        ref = sink_reference(q[s:e], ks, vs, HEAD_DIM ** -0.5, sinks, **knobs)
        assert (out[s:e].double() - ref).abs().max() <= tol * max(1.0, ref.abs().max()), (i, knobs)


@pytest.mark.parametrize("knobs", SINK_KNOBS, ids=SINK_IDS)
def test_sinks_match_the_definition(knobs):
    """Attention sinks (a logit per query head in the softmax's denominator only, each head its
    own, 4 query heads on each KV head): decodes, a prefill and prefill chunks over cached context
    in one step each equal the definition (scores, cap, mask, sink column, softmax, column
    dropped), causal, with a window that cuts contexts and the prefill, soft-capped, both; and
    the sinks change the output (the test would see them ignored)."""
    meta, q, k, v, cache, sinks = sink_step()
    backend = TorchAttentionBackend()
    assert backend.takes_sinks
    backend.prepare(meta)
    written = cache.clone()
    out = backend.forward(q, k, v, written, meta, HEAD_DIM ** -0.5, sinks=sinks, **knobs)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_sinks_match_reference(out, q, written, meta, sinks, 1e-5, **knobs)
    backend.prepare(meta)
    plain = backend.forward(q, k, v, cache.clone(), meta, HEAD_DIM ** -0.5, **knobs)
    assert (out - plain).abs().max() > 0.1


def test_sinks_never_take_the_masked_bmm(monkeypatch):
    """A bf16 batch of 8 decodes over 255 positions, which takes the masked bmm without sinks (it
    has no sink column), takes the written-out grouped decode with them: the definition's output
    within bf16's rounding."""
    monkeypatch.setattr(TorchAttentionBackend, "_masked_bmm", lambda *a: pytest.fail("masked bmm with sinks"))
    meta, q, k, v, cache, sinks = sink_step(DECODES["batch_8"], heads=9, kv_heads=3, dtype=torch.bfloat16)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5, sinks=sinks)
    assert out.dtype == torch.bfloat16
    _assert_sinks_match_reference(out, q, cache, meta, sinks, 2e-2)


@pytest.mark.parametrize("knobs", [dict(), dict(window=40, softcap=5.0)], ids=["causal", "softcap_window"])
def test_a_sink_of_minus_infinity_is_no_sink(knobs):
    """exp(-inf) = 0 joins no denominator: sinks of -inf give the output without sinks (the
    written-out path against SDPA's and the cap's), and sinks of -1e4 too; sinks of 0 do not."""
    meta, q, k, v, cache, _ = sink_step()
    backend = TorchAttentionBackend()

    def forward(sinks):
        backend.prepare(meta)
        return backend.forward(q, k, v, cache.clone(), meta, HEAD_DIM ** -0.5, sinks=sinks, **knobs)
    plain = forward(None)
    for logit in (float("-inf"), -1e4):
        assert (forward(torch.full((SINK_HEADS,), logit)) - plain).abs().max() < 1e-5, logit
    assert (forward(torch.zeros(SINK_HEADS)) - plain).abs().max() > 1e-3
