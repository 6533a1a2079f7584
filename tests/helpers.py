"""Factories shared by the tests: tiny random Llama models and engines over them."""
from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import torch

from engine.core.request import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from engine.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


# transformers' config and model classes of each family the tests build tiny models of
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
              "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
              "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
           num_key_value_heads=4)  # as many as the query heads: transformers repeats K/V by their ratio

# name -> (family, the config switches its published checkpoints use); windows of at most 2
# blocks of 16, prompts of at least 3 windows (tests/engine/models/test_families.py)
FAMILIES = {
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen2_yarn": ("qwen2", dict(max_position_embeddings=512, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mistral_window": ("mistral", dict(sliding_window=24, head_dim=32)),
    # its published switches, scaled down: soft-capped scores and logits, query_pre_attn_scalar
    # apart from head_dim, sliding and global layers alternating (layer_types)
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=24, tie_word_embeddings=True)),
    # scaled down likewise: q/k norms, sliding layers around a global one (the published five to one
    # cut to four layers: each layer type is a KV group, a step's cost), a rotary embedding per layer
    # type (the global one's base and linear x8 as 4B's, the sliding one's local base),
    # query_pre_attn_scalar apart from head_dim
    "gemma3": ("gemma3", dict(head_dim=32, num_hidden_layers=4, sliding_window=24, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                              tie_word_embeddings=True)),
    # mixtures of experts (engine/layers/moe.py): renormalized top-2 of 4 (Mixtral, with its window); a shared
    # expert, top-3 of 6 unrenormalized, every other layer sparse (Qwen2-MoE); q/k norms, a dense layer
    # listed in mlp_only_layers, renormalized top-2 of 8 (Qwen3-MoE)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24, head_dim=32)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
    # attention sinks, biases everywhere, sliding and full layers alternating, YaRN rope (its config's
    # default), router bias, top-2 of 4 experts with the clamped SwiGLU over interleaved rows
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
                                sliding_window=24)),
    # latent attention (engine/layers/mla.py), scaled down: V2-Lite's (no query low-rank projection, greedy
    # softmax routing, 2 shared experts), V2's (the query's, groups), V3's (sigmoid routing with the
    # correction bias over groups, renormalized and scaled, YaRN with mscale)
    "deepseek_v2_lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy")),
    "deepseek_v2": ("deepseek_v2", dict(MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3,
                                        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, routed_scaling_factor=16.0)),
    "deepseek_v3": ("deepseek_v3", dict(MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2,
                                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
}



def make_hf_tiny(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model of `family` (HF_CLASSES) with GQA, in fp32, built from its
    own config class (TINY's shape, `overrides` on top: the family's switches)."""
    import transformers
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[family])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss's experts' biases, its attention sinks
                p.add_(torch.randn_like(p) * 0.5)
            else:
                p.mul_(2.5)  # sharper distributions: greedy choices far from ties
        for name, b in model.named_buffers():  # DeepSeek-V3's routing correction, a buffer in transformers
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.5)
    return model


def make_hf_tiny_llama(seed: int = 0, **overrides):
    """A tiny random `transformers.LlamaForCausalLM` with GQA, in fp32."""
    return make_hf_tiny("llama", seed, **overrides)


def model_config_of(hf_model) -> ModelConfig:
    c = hf_model.config
    return ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                       num_kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                       rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta if hasattr(c, "rope_theta") else
                       c.rope_parameters["rope_theta"], rope_scaling=None,
                       max_position_embeddings=c.max_position_embeddings,
                       tie_word_embeddings=c.tie_word_embeddings, bos_token_id=1, eos_token_id=2, name="tiny")


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Writes a tiny random Llama as a HF safetensors folder; returns the folder."""
    return save_tiny(path, "llama", seed, **overrides)


def save_tiny(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Writes a tiny random model of `family` (make_hf_tiny) as a HF safetensors folder; returns it."""
    make_hf_tiny(family, seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path


@contextlib.contextmanager
def local_ray():
    """A local Ray for a fixture's scope, token auth on (a fresh token, nothing written to ~/.ray); its
    node carries 8 units of `worker`, the Ray resource of shared worker pods (spec worker_pods)."""
    from cluster.control.instance import setup_ray_auth
    setup_ray_auth()
    import ray
    ray.init(num_cpus=8, resources={"worker": 8}, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def engine_config(dtype: str = "float32", num_blocks: int = 256, block_size: int = 16,
                  max_num_batched_tokens: int = 256, max_num_seqs: int = 64, prefix_caching: bool = True,
                  model: str = "smollm2", kv_cache_dtype: str = "auto", quantization: str = "auto",
                  batch_invariant: bool = False, attention_backend: str = "auto",
                  host_tier_gib: float = 0.0, disk_tier_gib: float = 0.0,
                  disk_tier_dir: str | None = None) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype, device="cpu", quantization=quantization,
                        batch_invariant=batch_invariant, attention_backend=attention_backend,
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                          enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                                          host_tier_gib=host_tier_gib, disk_tier_gib=disk_tier_gib,
                                          disk_tier_dir=disk_tier_dir),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens))


def tiny_engine(hf_model, **knobs):
    """A ColocatedEngine over an in-memory tiny HF model (no tokenizer)."""
    from decode_worker.engine import ColocatedEngine
    from engine.runner.model_runner import ModelRunner
    cfg = engine_config(**knobs)
    runner = ModelRunner(cfg, model_config=model_config_of(hf_model), weights=hf_model.state_dict().items())
    return ColocatedEngine(cfg, runner=runner)


_ids = itertools.count()


def random_prompts(n: int, lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(lengths[i % len(lengths)]),), generator=g).tolist() for i in range(n)]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference greedy continuation by transformers, EOS ignored."""
    from transformers import GenerationConfig
    ids = torch.tensor([prompt])
    # eos_token_id=[] really ignores EOS; min_new_tokens would instead forbid it (a different sequence)
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():  # every position attended: a prompt may hold token 0 (the pad id given)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt):].tolist()


def all_logits(runner, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of `prompt`, fed in chunks through the paged cache.

    Writes blocks 1.. of the runner's cache directly, so only call it while the engine that owns
    the runner is idle; the caller then drops the engine's prefix cache (those blocks changed)."""
    rid = "logits-probe"
    blocks = runner.scratch_tables(len(prompt))
    assert blocks[-1][-1] < runner.num_blocks
    out = []
    try:
        for start in range(0, len(prompt), chunk):
            toks = prompt[start:start + chunk]
            if start == 0:
                sched = SchedulerOutput(new_requests=[NewRequestData(rid, toks, 0, blocks, SamplingParams(), True)])
            else:
                sched = SchedulerOutput(cached_requests=[CachedRequestData(rid, toks, start, (), True)])
            runner.update_states(sched)
            inp = runner.prepare_inputs(sched)
            with torch.inference_mode():
                hidden = runner.hidden_states(inp)
                out.append(runner.model.compute_logits(hidden))
    finally:
        runner.update_states(SchedulerOutput(finished_req_ids=[rid]))
    return torch.cat(out)


def assert_logits_match_transformers(runner, hf_model, prompt: list[int], chunks=(1000, 7, 1)) -> None:
    """The runner's logits at every position of `prompt` equal the HF model's (fp32: 2e-4 absolute,
    1e-4 relative), fed at once and in each of `chunks` over cached context (1: token by token)."""
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    for chunk in chunks:
        torch.testing.assert_close(all_logits(runner, prompt, chunk), ref, atol=2e-4, rtol=1e-4)


def assert_logprobs_close(got: list[dict[int, float]], want: list[dict[int, float]], tol: float = 1e-4) -> None:
    """Per token: the same sampled token (each map's first key) with a close logprob, and close
    top-n values (compared sorted, so a near-tie ordered differently does not fail)."""
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        (gt, glp), (wt, wlp) = next(iter(g.items())), next(iter(w.items()))
        assert gt == wt and abs(glp - wlp) <= tol, (i, gt, glp, wt, wlp)
        gv, wv = sorted(g.values(), reverse=True), sorted(w.values(), reverse=True)
        assert len(gv) == len(wv) and max(abs(a - b) for a, b in zip(gv, wv)) <= tol, (i, gv, wv)


def _run_rank(target, rank: int, port: int, args: tuple, out) -> None:
    """One spawned rank: `target`, then its results flushed and an exit without the interpreter's
    teardown, where a C++ thread left to the static destructors (gloo's) aborted a rank now and then
    ("terminate called without an active exception") after its work was done. An exception in
    `target` still ends the process nonzero."""
    target(rank, port, *args, out)
    out.close()
    out.join_thread()
    os._exit(0)


def run_gloo_ranks(target, args: tuple, num_results: int, world: int = 2, timeout_s: float = 180) -> list:
    """Runs `target(rank, port, *args, out)` in `world` spawned processes (a gloo group on a free
    loopback port); returns the `num_results` items they put on `out`, once every rank exited 0."""
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(target, r, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout_s) for _ in range(num_results)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def generate_steps(engine, prompts, max_tokens: int) -> list[tuple[list[int], list, int]]:
    """Greedy runs of `prompts` through a ColocatedEngine stepped by hand: per prompt its tokens,
    their top-2 logprobs and how many prompt tokens came from the prefix cache."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    ids = [f"r{i}-{len(engine.scheduler.requests)}-{id(p)}" for i, p in enumerate(prompts)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    reqs = {rid: engine.scheduler.requests[rid] for rid in ids}
    while engine.has_unfinished():
        engine.step()
    return [(reqs[rid].output_token_ids, [e["logprobs"] for e in reqs[rid].output_extras], reqs[rid].num_cached_tokens)
            for rid in ids]
