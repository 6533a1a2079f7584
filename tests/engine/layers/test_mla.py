"""DeepSeek's latent attention (engine/layers/mla.py): the cache holds one entry per token (the latent and
the rotary key, transformers' own cached values), the absorbed and expanded forms give
transformers' logits, an fp8 cache stays within its rounding, and what cannot run it is refused.
The families' logits and greedy tokens against transformers: tests/engine/models/test_families.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention import create_attention_backend
from engine.core.choices import FORMS, PrefillForms
from engine.core.kv_cache import kv_block_bytes
from engine.layers.mla import MLAAttention, deinterleave_rows
from engine.loading.loader import hf_model_config
from engine.runner.model_runner import ModelRunner
from tests.helpers import (FAMILIES, all_logits, assert_logits_match_transformers, engine_config, make_hf_tiny,
                           random_prompts)


@pytest.fixture(scope="module", params=["deepseek_v2_lite", "deepseek_v3"])
def deepseek(request, tmp_path_factory):
    """(name, the HF model, its saved folder)."""
    kind, switches = FAMILIES[request.param]
    hf = make_hf_tiny(kind, seed=7, **switches)
    folder = tmp_path_factory.mktemp(request.param) / request.param
    hf.save_pretrained(folder, safe_serialization=True)
    return request.param, hf, folder


def _mla_layers(runner: ModelRunner) -> list[MLAAttention]:
    return [layer.self_attn for layer in runner.model.layers]


def test_the_cache_holds_each_tokens_latent_and_rotary_key(deepseek):
    """After a prefill, a layer's slots hold [normed latent | rotated rope key], the two values
    transformers caches for the layer (V3's rotary output is already in halves; V2's complex
    rotation keeps pairs, put in halves here), split over the pool's two planes; and a block's
    bytes are one entry per token and layer."""
    name, hf, folder = deepseek
    runner = ModelRunner(engine_config(model=str(folder), num_blocks=16))
    prompt = random_prompts(1, [40], seed=2)[0]
    all_logits(runner, prompt, 1000)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).cache
    cfg = hf_model_config(folder)
    mla = cfg.mla
    assert runner.kv_cache.shape[-2:] == (1, mla.entry_size // 2)
    assert kv_block_bytes(cfg, 1, 16, torch.float32) == cfg.num_layers * 16 * mla.entry_size * 4
    slots = torch.arange(40) + 16  # the probe's context starts at block 1 (tests/helpers.py all_logits)
    for i, layer in enumerate(cache.layers):
        planes = runner.kv_cache[i].view(2, -1, mla.entry_size // 2)[:, slots]
        entry = torch.cat([planes[0], planes[1]], dim=-1)
        latent, rope = layer.keys[0, 0], layer.values[0, 0]
        if name.startswith("deepseek_v2"):
            rope = deinterleave_rows(rope.T, mla.qk_rope_head_dim, mla.qk_rope_head_dim).T
        torch.testing.assert_close(entry, torch.cat([latent, rope], dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_each_prefill_form_gives_transformers_logits(deepseek, form):
    """Every prefill in the expanded form, or in the absorbed one (as decodes run), at once and in
    chunks of 7 over cached context: transformers' logits at every position."""
    name, hf, folder = deepseek
    runner = ModelRunner(engine_config(model=str(folder)))
    for layer in _mla_layers(runner):
        layer.prefill_forms = PrefillForms.fixed(form)
    assert_logits_match_transformers(runner, hf, random_prompts(1, [60], seed=4)[0], chunks=(1000, 7))


def test_absorbed_decodes_equal_expanded_ones(deepseek):
    """32 greedy tokens for three prompts decoded together, absorbed (the default) and expanded (one
    sequence at a time): the same tokens, and top logprobs within 1e-4."""
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    _, _, folder = deepseek
    prompts = random_prompts(3, [5, 30, 70], seed=8)
    outs = {}
    for form in FORMS:
        cfg = engine_config(model=str(folder))
        llm = LLM(engine=ColocatedEngine(cfg, runner=ModelRunner(cfg)))
        for layer in _mla_layers(llm.engine.runner):
            layer.decode_form = form
        outs[form] = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                          logprobs=2))
    for a, b in zip(outs["absorbed"], outs["expanded"]):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x if t in y)


def test_a_prefix_cache_hit_reads_the_cached_latents(deepseek):
    """A second prompt sharing a 48-token prefix starts from the first one's cached entries (3
    blocks) and still decodes transformers' 16 greedy tokens."""
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    from tests.helpers import hf_greedy
    _, hf, folder = deepseek
    cfg = engine_config(model=str(folder))
    llm = LLM(engine=ColocatedEngine(cfg, runner=ModelRunner(cfg)))
    prefix = random_prompts(1, [48], seed=10)[0]
    first, second = (prefix + tail for tail in random_prompts(2, [9, 20], seed=11))
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate([first], greedy)
    (out,) = llm.generate([second], greedy)
    assert out.num_cached_tokens == 48 and out.token_ids == hf_greedy(hf, second, 16)


def test_an_fp8_cache_stays_within_its_rounding(deepseek):
    """--kv-cache-dtype fp8_e4m3: the entries in e4m3 (scale 1), logits near the fp32 cache's
    (measured max change 0.05-0.07 against logits up to 1.5)."""
    _, _, folder = deepseek
    prompt = random_prompts(1, [50], seed=6)[0]
    full, fp8 = (all_logits(ModelRunner(engine_config(model=str(folder), kv_cache_dtype=kv)), prompt, 7)
                 for kv in ("auto", "fp8_e4m3"))
    change = (full - fp8).abs().max().item()
    print(f"\n[mla fp8] max logit change {change:.4f}")
    assert 0 < change < 0.2 and (full.argmax(-1) == fp8.argmax(-1)).float().mean() >= 0.9


def test_a_bf16_model_loads_and_stays_near_float32(deepseek):
    """In bf16 (the router in float32 beside bf16 experts: the expert methods are timed on the
    experts' dtype), the logits stay near float32's (measured max change 0.013-0.020, top-1 1.0)."""
    _, _, folder = deepseek
    prompt = random_prompts(1, [40], seed=12)[0]
    full, half = (all_logits(ModelRunner(engine_config(model=str(folder), dtype=dtype)), prompt, 1000).float()
                  for dtype in ("float32", "bfloat16"))
    change, top1 = (full - half).abs().max().item(), (full.argmax(-1) == half.argmax(-1)).float().mean().item()
    print(f"\n[mla bf16] max logit change {change:.3f}, top-1 {top1:.3f}")
    assert change < 0.1 and top1 >= 0.95


def test_backends_without_a_latent_path_are_refused(deepseek):
    """auto and torch run it; flex, vllm_cpu, flash_attn and --batch-invariant are refused naming
    MLA, before the model loads."""
    _, _, folder = deepseek
    cpu = torch.device("cpu")
    assert create_attention_backend("auto", cpu, torch.float32, mla=True).name == "torch"
    for name in ("flex", "vllm_cpu", "flash_attn"):
        with pytest.raises(ValueError, match=f"attention backend {name} has no latent-attention"):
            create_attention_backend(name, cpu, torch.float32, mla=True)
    with pytest.raises(ValueError, match="--batch-invariant has no latent-attention"):
        ModelRunner(engine_config(model=str(folder), batch_invariant=True))
    with pytest.raises(ValueError, match="vllm_cpu has no latent-attention"):
        ModelRunner(replace(engine_config(model=str(folder)), attention_backend="vllm_cpu"))
