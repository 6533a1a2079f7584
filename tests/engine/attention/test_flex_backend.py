"""The flex attention backend (torch's FlexAttention, compiled by inductor's C++ path on this CPU)
against the torch backend on random paged caches, in fp32: decode-only, prefill-only and mixed
steps, prefill chunks over cached context, sliding windows, soft-capping, attention sinks, GQA
ratios, block tables of scattered blocks, an fp8 cache, steps past the smallest padded shape;
garbage (NaN) in the cache's unused memory never reaches an output. End to end, every model
family's engine on flex gives the torch backend's greedy tokens and logprobs. And where `auto`
picks it.

Compile time counts: every case here shares the padded shapes of the families' tiny models (4
query heads on 2 KV heads, head_dim 32, Gemma 2's scale and cap for the soft-capped ones), so the
whole file compiles 8 graphs (2 of them attention sinks')."""
from __future__ import annotations

import re

from dataclasses import replace

import pytest
import torch

from cluster.spec import ClusterSpec
from decode_worker.engine import ColocatedEngine
from engine.attention import create_attention_backend
from engine.attention import flex_backend
from engine.attention.base import FP8
from engine.attention.flex_backend import MIN_KEYS, MIN_QUERIES, FlexAttentionBackend, padded
from engine.attention.torch_backend import TorchAttentionBackend
from engine.runner.model_runner import ModelRunner
from tests.engine.attention.test_flash_backend import build_metadata
from tests.helpers import FAMILIES, engine_config, generate_steps, make_hf_tiny, random_prompts

WHY = flex_backend.flex_unavailable(torch.device("cpu"))
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"flex: {WHY}")

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # the families' tiny shape (qwen3, mistral_window, gemma2)
SCALE = HEAD_DIM ** -0.5
GEMMA_SCALE, GEMMA_CAP = 24 ** -0.5, 5.0  # FAMILIES["gemma2"]: query_pre_attn_scalar 24, soft cap 5
TOL = 1e-5  # fp32: max |flex - torch| <= TOL * max(1, max |torch|)

# (cached tokens, new tokens) per sequence: build_metadata puts decodes first, blocks at random
STEPS = {
    "decode_only": [(100, 1), (37, 1), (3, 1), (0, 1)],
    "prefill_only": [(0, 70), (0, 9), (0, 1 + 16)],
    "mixed": [(100, 1), (37, 1), (0, 70), (0, 9)],
    "chunked_over_cache": [(61, 24), (130, 7), (16, 16), (45, 1)],
}


def _step(seqs, heads=HEADS, kv_heads=KV_HEADS, block_size=16, seed=0, q_gain=1.0):
    """A step's metadata, q/k/v and a random cache (the cached context, and finite garbage elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = build_metadata(seqs, block_size, gen)
    n = sum(meta.query_lens)
    q = torch.randn(n, heads, HEAD_DIM, generator=gen) * q_gain
    k, v = (torch.randn(n, kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen)
    return meta, q, k, v, cache


def _forward(backend, meta, q, k, v, cache, **knobs):
    knobs = {"scale": SCALE, **knobs}
    backend.prepare(meta)
    return backend.forward(q, k, v, cache.clone(), meta, **knobs)


@pytest.fixture(scope="module")
def flex():
    return FlexAttentionBackend(torch.device("cpu"))


def _assert_matches_torch(flex, step, **knobs):
    got = _forward(flex, *step, **knobs)
    want = _forward(TorchAttentionBackend(), *step, **knobs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= TOL * max(1.0, want.abs().max()), (got - want).abs().max()
    return got


@pytest.mark.parametrize("name", list(STEPS))
def test_matches_the_torch_backend(flex, name):
    """Decodes and prefills, alone and mixed in one step, prefill chunks over cached context: one
    flex call per layer over the whole packed step gives each token the torch backend's output."""
    _assert_matches_torch(flex, _step(STEPS[name]))


@pytest.mark.parametrize("window", [1, 16, 20, 1000])
def test_sliding_window(flex, window):
    """A query at position p sees keys p - W + 1 .. p: decodes several windows on, chunks over
    cached context longer than the window, a window wider than every context (the torch backend's)."""
    _assert_matches_torch(flex, _step(STEPS["mixed"] + [(61, 24)]), window=window)


@pytest.mark.parametrize("window", [None, 24])
def test_softcap(flex, window):
    """Gemma 2's soft-capped scores (cap * tanh(score / cap), scores of tens: the cap changes
    them), alone and with a window."""
    step = _step(STEPS["mixed"] + [(61, 24)], q_gain=4.0)
    got = _assert_matches_torch(flex, step, scale=GEMMA_SCALE, softcap=GEMMA_CAP, window=window)
    uncapped = _forward(TorchAttentionBackend(), *step, scale=GEMMA_SCALE, window=window)
    assert (got - uncapped).abs().max() > 0.1  # the cap is applied, not ignored


@pytest.mark.parametrize("knobs", [dict(), dict(window=20), dict(scale=GEMMA_SCALE, softcap=GEMMA_CAP)],
                         ids=["causal", "window", "softcap"])
def test_attention_sinks(flex, knobs):
    """gpt-oss's sinks (a logit per query head in the softmax's denominator only, each head its
    own), through the sink key: every token gets the torch backend's output, with a window and
    under a soft cap (the sink itself uncapped); the padding query rows leave the real ones finite;
    the sinks change the output, and sinks of -inf give the output without them."""
    step = _step(STEPS["mixed"] + [(61, 24)], q_gain=4.0 if "softcap" in knobs else 1.0)
    sinks = torch.rand(HEADS, generator=torch.Generator().manual_seed(1)) * 8 - 1  # -1..7
    assert flex.takes_sinks
    got = _assert_matches_torch(flex, step, sinks=sinks, **knobs)
    assert torch.isfinite(got).all()
    plain = _forward(flex, *step, **knobs)
    assert (got - plain).abs().max() > 0.1
    none = _forward(flex, *step, sinks=torch.full((HEADS,), float("-inf")), **knobs)
    assert (none - plain).abs().max() <= TOL * max(1.0, plain.abs().max())


def test_the_sink_key_lies_past_the_real_keys():
    """The plan with sinks: one key more (2048 real keys pad to 4096), the sink key at index
    num_keys for every real query and none for the padding rows, and its tile visited (never
    skipped as full) by every query tile holding a real row, and by no other."""
    meta, *_ = _step([(2000, 1), (0, 47)])
    plain, sunk = flex_backend.plan_step(meta, None), flex_backend.plan_step(meta, None, sinks=True)
    assert plain.sink_key is None and (plain.num_padded_keys, sunk.num_padded_keys) == (2048, 4096)
    assert sunk.sink_key[:48].eq(2048).all() and sunk.sink_key[48:].eq(-1).all()
    tile = 2048 // flex_backend.KV_BLOCK
    mask = sunk.block_mask
    listed = [tile in mask.kv_indices[0, 0, i, :mask.kv_num_blocks[0, 0, i]].tolist()
              for i in range(mask.kv_num_blocks.shape[-1])]
    full = [tile in mask.full_kv_indices[0, 0, i, :mask.full_kv_num_blocks[0, 0, i]].tolist()
            for i in range(mask.full_kv_num_blocks.shape[-1])]
    assert listed == [i * flex_backend.Q_BLOCK < 48 for i in range(len(listed))] and not any(full)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_gqa_ratios(flex, heads, kv_heads):
    """Every query head reads its own KV head: multi-head (no grouping) and multi-query."""
    _assert_matches_torch(flex, _step(STEPS["mixed"], heads=heads, kv_heads=kv_heads))


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_and_scattered_tables(flex, block_size):
    """Block tables of blocks drawn at random from the pool (never contiguous), other block sizes."""
    step = _step(STEPS["chunked_over_cache"], block_size=block_size, seed=3)
    tables = step[0].block_tables
    assert any((row[1:] - row[:-1] != 1).any() for row in tables)
    _assert_matches_torch(flex, step)


def test_past_the_smallest_padded_shape(flex):
    """A step of 301 tokens over 3001 keys runs padded to 512 queries x 4096 keys (its own graph)."""
    _assert_matches_torch(flex, _step([(699, 1), (2000, 300)]))
    assert (padded(301, MIN_QUERIES), padded(3001, MIN_KEYS)) == (512, 4096)
    assert [padded(n, MIN_QUERIES) for n in (1, 256, 257)] == [256, 256, 512]


def _used_slots(meta) -> torch.Tensor:
    """Flat slots of every position 0..seq_len-1 of every sequence: the cache's written memory."""
    bs = meta.block_size
    return torch.cat([meta.block_tables[i].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
                      for i, n in enumerate(meta.seq_lens_cpu)])


@pytest.mark.parametrize("window", [None, 20])
def test_nan_in_unused_memory_never_reaches_an_output(flex, window):
    """Fill every slot no sequence has written (block 0, free blocks, the tails of last blocks)
    with NaN; with a window, point the blocks wholly before each sequence's window at the null
    block (as a sliding layer's released blocks are). The outputs are finite and exactly those
    of the clean cache: masked keys get weight 0 and 0 * NaN is NaN, so only written rows and
    zeros may ever enter the kernel."""
    meta, q, k, v, cache = _step(STEPS["mixed"] + [(130, 7)], seed=5)
    clean = _forward(flex, meta, q, k, v, cache, window=window)
    dirty = torch.full_like(cache, float("nan"))
    used = _used_slots(meta)
    for i in range(2):
        dirty[i].view(-1, KV_HEADS, HEAD_DIM)[used] = cache[i].view(-1, KV_HEADS, HEAD_DIM)[used]
    if window is not None:
        tables = meta.block_tables.clone()
        for i, (q_len, n) in enumerate(zip(meta.query_lens, meta.seq_lens_cpu)):
            first_seen = max(0, n - q_len - window + 1)
            tables[i, :first_seen // meta.block_size] = 0
        meta = replace(meta, block_tables=tables)
    got = _forward(flex, meta, q, k, v, dirty, window=window)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_fp8_cache_is_dequantized_on_read(flex, k_scale, v_scale):
    """An fp8_e4m3 cache: new K/V stored rounded, every key read back dequantized (times its
    scale) in the compute dtype, as the torch backend reads it."""
    meta, q, k, v, cache = _step(STEPS["mixed"], seed=7)
    cache = cache.clamp(-400, 400).to(FP8)
    _assert_matches_torch(flex, (meta, q, k, v, cache), k_scale=k_scale, v_scale=v_scale)


# -- end to end: every family's engine ---------------------------------------------------------

@pytest.fixture(scope="module", params=[name for name, (_, switches) in FAMILIES.items()
                                        if "kv_lora_rank" not in switches])  # latent attention: torch alone
def family_folder(request, tmp_path_factory):
    kind, switches = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param) / request.param
    make_hf_tiny(kind, seed=len(request.param), **switches).save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(folder, backend: str) -> ColocatedEngine:
    """32 tokens a step: prompts are chunked, and decodes run beside the chunks in one step."""
    cfg = replace(engine_config(model=str(folder), num_blocks=96, max_num_batched_tokens=32),
                  attention_backend=backend)
    return ColocatedEngine(cfg, runner=ModelRunner(cfg))


def test_family_matches_the_torch_backend(family_folder):
    """Prompts of 5-90 tokens (windows of 20-24: several windows back), 12 greedy tokens each, all
    in flight together (chunked prefills beside decodes), then the same prompts again (prefix-cache
    hits): the same tokens as the torch backend, logprobs within 1e-4; no block leaks."""
    prompts = random_prompts(4, [5, 30, 62, 90], seed=5)
    ours, ref = _engine(family_folder, "flex"), _engine(family_folder, "torch")
    assert ours.runner.backend.name == "flex"
    got = generate_steps(ours, prompts, 12) + generate_steps(ours, prompts, 12)
    want = generate_steps(ref, prompts, 12) + generate_steps(ref, prompts, 12)
    assert any(cached for _, _, cached in got[4:])
    for (tokens, logprobs, cached), (ref_tokens, ref_logprobs, ref_cached) in zip(got, want):
        assert tokens == ref_tokens and cached == ref_cached
        for step, ref_step in zip(logprobs, ref_logprobs):
            assert step.keys() == ref_step.keys()
            assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step)
    ours.kv.assert_no_leaks()


# -- where it runs -----------------------------------------------------------------------------

def test_auto_on_cuda_without_flash_attn_picks_flex_and_says_why(monkeypatch, caplog):
    """On a (faked) CUDA device, `auto` without flash-attn, or in fp32, is flex, logged with the
    reason; where flex cannot compile either (no triton), it is torch, logged with both reasons."""
    import engine.attention as attention
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "flash_attn_unfit", lambda: "flash_attn is not installed")
    monkeypatch.setattr(flex_backend, "flex_unavailable", lambda device: None)
    with caplog.at_level("INFO", logger="engine.attention"):
        assert create_attention_backend("auto", cuda, torch.bfloat16, None, 64).name == "flex"
        assert create_attention_backend("auto", cuda, torch.float32, None, 64).name == "flex"
    assert "attention backend: flex (flash_attn is not installed)" in caplog.text
    assert "attention backend: flex (flash_attn needs fp16/bf16)" in caplog.text
    monkeypatch.setattr(flex_backend, "flex_unavailable", lambda device: "triton is not installed")
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.attention"):
        assert create_attention_backend("auto", cuda, torch.bfloat16, None, 64).name == "torch"
    assert "torch (flash_attn is not installed; flex cannot run: triton is not installed)" in caplog.text
    with pytest.raises(ValueError, match="flex cannot run: triton is not installed"):
        create_attention_backend("flex", cuda, torch.bfloat16)


@pytest.mark.parametrize("version,why", [
    ("2.5.9", "flash-attn 2.5.9 is older than 2.6"), (None, "flash-attn (no version) is older than 2.6"),
    ("missing", "flash_attn is not installed"), ("2.6.3", None), ("2.7.4.post1", None), ("3.0.0b1", None)])
def test_flash_attn_older_than_2_6_is_not_taken(monkeypatch, caplog, version, why):
    """flash-attn below 2.6 (or without a version, or missing) is never what `auto` picks on a
    (faked) CUDA device, logged with why, and refused by name when asked for; 2.6 and later is taken."""
    import sys
    import types

    import engine.attention as attention
    fake = None if version == "missing" else types.ModuleType("flash_attn")
    if version not in (None, "missing"):
        fake.__version__ = version
    monkeypatch.setitem(sys.modules, "flash_attn", fake)  # None: `import flash_attn` raises ImportError
    monkeypatch.setattr(flex_backend, "flex_unavailable", lambda device: None)
    assert attention.flash_attn_unfit() == why if why is None else why in attention.flash_attn_unfit()
    if why is None:
        return
    with caplog.at_level("INFO", logger="engine.attention"):
        assert create_attention_backend("auto", torch.device("cuda"), torch.bfloat16, None, 64).name == "flex"
    assert f"attention backend: flex ({why}" in caplog.text
    with pytest.raises(ValueError, match=f"attention backend flash_attn cannot run: {re.escape(why)}"):
        create_attention_backend("flash_attn", torch.device("cuda"), torch.bfloat16, None, 64)


def test_a_model_with_attention_sinks_gets_a_backend_that_takes_them(monkeypatch, caplog):
    """gpt-oss's sinks: `auto` on a (faked) CUDA device with flash-attn installed picks flex, saying
    why; a backend without sinks is refused by name (the batch-invariant one here)."""
    import engine.attention as attention
    monkeypatch.setattr(attention, "flash_attn_unfit", lambda: None)
    monkeypatch.setattr(flex_backend, "flex_unavailable", lambda device: None)
    with caplog.at_level("INFO", logger="engine.attention"):
        backend = create_attention_backend("auto", torch.device("cuda"), torch.bfloat16, None, 64, sinks=True)
        assert backend.name == "flex"
    assert "attention backend: flex (flash_attn takes no attention sinks)" in caplog.text
    assert create_attention_backend("auto", torch.device("cpu"), torch.float32, None, 64, sinks=True).takes_sinks
    with pytest.raises(ValueError, match="attention backend batch_invariant cannot take the model's attention sinks"):
        create_attention_backend("auto", torch.device("cpu"), torch.float32, batch_invariant=True, sinks=True)


def test_explicit_flex_on_a_cpu_and_what_refuses_it():
    """`flex` is never what `auto` picks on a CPU, but runs there when asked, fp8 cache included;
    the batch-invariant mode keeps its own attention (refused, in the spec too)."""
    cpu = torch.device("cpu")
    assert create_attention_backend("auto", cpu, torch.float32, None, 64).name != "flex"
    assert create_attention_backend("flex", cpu, torch.float32, None, 64).name == "flex"
    assert create_attention_backend("flex", cpu, torch.bfloat16, FP8, 64).name == "flex"
    with pytest.raises(ValueError, match="batch-invariant"):
        create_attention_backend("flex", cpu, torch.float32, batch_invariant=True)
    assert ClusterSpec(attention_backend="flex").attention_backend == "flex"
    with pytest.raises(ValueError, match="batch_invariant"):
        ClusterSpec(attention_backend="flex", batch_invariant=True)
