"""The batch-invariant mode (engine/quant/batch_invariant.py): each row's numbers are a function of that
row alone, bit for bit, and close to the plain computation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_worker.llm import LLM
from engine.core.request import SamplingParams
from engine.quant import batch_invariant
from engine.quant.base import mkldnn_packing_available
from engine.quant.batch_invariant import fixed_split_attention, fixed_split_decode, tiled_linear
from tests.helpers import all_logits, make_hf_tiny_llama, random_prompts, tiny_engine


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not mkldnn_packing_available(torch.float32), reason="oneDNN weight packing: not in this torch build"))])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 1536), (1536, 576)])
def test_tiled_linear_rows_do_not_depend_on_the_batch(k, n, packed):
    """A row's output is the same alone, among 40, at any place in its tile, and a column shard (a
    TP rank's) gives exactly its columns of the whole; it is x W^T + b up to rounding. Both
    kernels: the batched matmul and oneDNN's prepacked one."""
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(40, k)
    pack = (lambda t: torch.ops.mkldnn._reorder_linear_weight(t)) if packed else (lambda t: None)
    whole = tiled_linear(x, w, b, pack(w))
    torch.testing.assert_close(whole, F.linear(x, w, b), rtol=1e-4, atol=1e-3)
    for start, m in ((0, 1), (5, 1), (3, 17), (7, 33)):
        assert torch.equal(tiled_linear(x[start:start + m], w, b, pack(w)), whole[start:start + m]), (start, m)
    third = slice(n // 3, 2 * n // 3)
    assert torch.equal(tiled_linear(x, w[third], b[third], pack(w[third].contiguous())), whole[:, third])


def reference_attention(q, k, v, scale, window=None, softcap=None):
    """Causal attention of queries at positions L - q_len .. L - 1, in float64."""
    q_len, heads, _ = q.shape
    length = k.shape[0]
    group = heads // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(length - q_len, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).float()


KNOBS = [dict(), dict(window=24), dict(softcap=5.0)]


@pytest.mark.parametrize("knobs", KNOBS, ids=["causal", "window", "softcap"])
def test_fixed_split_attention_matches_the_reference(knobs):
    torch.manual_seed(1)
    k, v = torch.randn(150, 2, 16), torch.randn(150, 2, 16)
    q = torch.randn(150, 4, 16)
    for q_len in (150, 40, 1):
        got = fixed_split_attention(q[-q_len:], k, v, 0.25, **knobs)
        torch.testing.assert_close(got, reference_attention(q[-q_len:], k, v, 0.25, **knobs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knobs", KNOBS, ids=["causal", "window", "softcap"])
def test_a_query_does_not_depend_on_how_it_is_attended(knobs, monkeypatch):
    """Decoded alone (context up to it), prefilled whole, in chunks of 13 or 40, or in small groups
    of query tiles: every query's output is bit-equal."""
    torch.manual_seed(2)
    k, v, q = torch.randn(150, 2, 16), torch.randn(150, 2, 16), torch.randn(150, 4, 16)
    whole = fixed_split_attention(q, k, v, 0.25, **knobs)
    for p in (0, 15, 31, 32, 33, 100, 149):
        assert torch.equal(fixed_split_attention(q[p:p + 1], k[:p + 1], v[:p + 1], 0.25, **knobs), whole[p:p + 1]), p
    for chunk in (13, 40):
        pieces = [fixed_split_attention(q[a:a + chunk], k[:a + chunk], v[:a + chunk], 0.25, **knobs)
                  for a in range(0, 150, chunk)]
        assert torch.equal(torch.cat(pieces), whole), chunk
    monkeypatch.setattr(batch_invariant, "MAX_TILE_SPLITS", 3)  # groups of query tiles over fewer keys each
    assert torch.equal(fixed_split_attention(q, k, v, 0.25, **knobs), whole)


@pytest.mark.parametrize("knobs", KNOBS, ids=["causal", "window", "softcap"])
def test_decodes_together_equal_each_alone(knobs):
    """Five sequences' newest queries attended in one call (contexts of 1 to 150 keys, padded with
    rows of anything) give, bit for bit, each one's own `fixed_split_attention`."""
    torch.manual_seed(3)
    lengths = torch.tensor([1, 33, 150, 64, 7])
    k, v, q = torch.randn(5, 160, 2, 16), torch.randn(5, 160, 2, 16), torch.randn(5, 4, 16)
    k[0, 1:], v[0, 1:] = float("nan"), float("inf")  # past a context: never read, whatever it holds
    together = fixed_split_decode(q, k, v, lengths, 0.25, **knobs)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(together[b:b + 1], fixed_split_attention(q[b:b + 1], k[b, :n], v[b, :n], 0.25, **knobs)), b


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_tiny_llama(seed=7)


def test_runner_logits_do_not_depend_on_chunking(hf_model):
    """A prompt's logits at every position, fed in chunks of 7, 64 or whole: bit-equal in the
    batch-invariant mode, and close to the default mode's."""
    engine = tiny_engine(hf_model, batch_invariant=True)
    prompt = random_prompts(1, [150], seed=5)[0]
    whole = all_logits(engine.runner, prompt, 150)
    for chunk in (7, 64):
        assert torch.equal(all_logits(engine.runner, prompt, chunk), whole), chunk
    default = tiny_engine(hf_model)
    torch.testing.assert_close(whole, all_logits(default.runner, prompt, 150), rtol=1e-4, atol=1e-4)


def test_requests_batched_equal_alone(hf_model):
    """12 requests of mixed lengths, batched, chunked and preempted (a small KV pool), each give
    the tokens and logprobs, bit for bit, that they give alone: the default mode's kernels differ
    by batch size; this mode's do not."""
    prompts = random_prompts(12, [3, 150, 40, 9, 77, 25], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(engine=tiny_engine(hf_model, batch_invariant=True, max_num_batched_tokens=64, num_blocks=40))
    batched = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for i in (0, 1, 4, 7):
        alone = LLM(engine=tiny_engine(hf_model, batch_invariant=True, prefix_caching=False)).generate(
            [prompts[i]], params)[0]
        assert batched[i].token_ids == alone.token_ids, i
        assert batched[i].logprobs == alone.logprobs, i


def test_quantized_weights_are_refused(hf_model):
    with pytest.raises(ValueError, match="--batch-invariant runs unquantized weights; --quantization int8"):
        tiny_engine(hf_model, batch_invariant=True, quantization="int8")
