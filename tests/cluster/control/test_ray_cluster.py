"""The cluster on Ray: one actor per rank, TP groups across processes, heterogeneous TP between
prefill and decode, failover and membership changes. Greedy fp32 outputs must equal the colocated
engine's token for token."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import ray

from bench.otlp_sink import OTLPReceiver
from engine.core import tracing
from cluster.autoscale.actuators import PoolSizes, RayActuator
from cluster.control.cluster import Cluster
from cluster.ranks.nodes import PlacementError, RankPlacement
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams
from tests.helpers import FAMILIES, assert_logprobs_close, random_prompts, save_tiny, save_tiny_llama

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)


def spec_for(model: str, **kw) -> ClusterSpec:
    base = dict(model=model, dtype="float32", device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=16,
                max_num_batched_tokens=128, kv_transfer_timeout_s=10.0, num_threads=1, router_policy="round_robin")
    return ClusterSpec(**{**base, **kw})


def colocated_streams(model: str, prompts, params=GREEDY) -> list:
    with Cluster(spec_for(model, mode="colocated"), use_ray=False) as c:
        return c.generate(prompts, params, timeout_s=120)


def colocated_tokens(model: str, prompts, params=GREEDY) -> list[list[int]]:
    return [s.token_ids for s in colocated_streams(model, prompts, params)]


def checked(streams) -> list[list[int]]:
    assert [s.error for s in streams] == [None] * len(streams)
    return [s.token_ids for s in streams]


@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1), (2, 2)])
def test_tp_mixes_match_colocated(ray_session, tiny_path, ptp, dtp):
    """P tp=1 -> D tp=2, P tp=2 -> D tp=1, and TP=2 on both: each decode rank gets its KV heads
    from the right prefill ranks; outputs and their logprobs (the first token's from the prefill
    driver, the rest from the decode driver) equal colocated; every allocator ends empty. A second
    turn fetches a block of the first's output from the decode ranks into the prefill ranks (every
    rank of each expects or ships its heads) and equals colocated too. Every rank
    runs at nice 0 (not Ray's 15) with the spec's one intra-op thread, fixed, and the environment's
    OpenMP wait policy (the spec's default)."""
    prompts = random_prompts(6, [7, 30, 140], seed=ptp * 10 + dtp)
    with Cluster(spec_for(tiny_path, prefill_tp=ptp, decode_tp=dtp), log_level="WARNING") as c:
        streams = c.generate(prompts, GREEDY_LOGPROBS, timeout_s=120)
        got = checked(streams)
        # a second turn: the decode instance holds the first with its output (18 blocks), the prefill
        # instance its prompt (17): the prefill's ranks fetch the 18th block from the decode's ranks
        prompts.append(prompts[2] + got[2] + random_prompts(1, [6], seed=99)[0])
        prefill, decode = (next(i for i in c.instances.values() if i.role == role) for role in ("prefill", "decode"))
        deadline = time.monotonic() + 30
        while c.router.fetches.index.longest_prefix(prompts[-1], [decode.client.info])[decode.instance_id] < 18:
            assert time.monotonic() < deadline, "the router did not learn the decode instance's blocks"
            time.sleep(0.05)
        streams += c.generate(prompts[-1:], GREEDY_LOGPROBS, timeout_s=120)
        got = checked(streams)
        load = prefill.client.load()
        assert (load["kv_fetches"], load["kv_fetched_tokens"], load["kv_fetches_failed"]) == (1, 8, 0)
        c.assert_no_leaks()
        for inst in c.instances.values():  # where the ranks are: loopback on a driver-started Ray
            pids = ray.get([r.pid.remote() for r in inst.ranks])
            assert [replace(p, cpu={}) for p in inst.placements] == [
                RankPlacement(r, "127.0.0.1", pid) for r, pid in enumerate(pids)]
            wait = os.environ.get("OMP_WAIT_POLICY", "default")
            assert all((p.cpu["niceness"], p.cpu["omp_wait_policy"], p.cpu["intraop_threads"], p.cpu["adapt_threads"])
                       == (0, wait, 1, False) for p in inst.placements), inst.placements
    want = colocated_streams(tiny_path, prompts, GREEDY_LOGPROBS)
    assert got == [s.token_ids for s in want]
    for s, w in zip(streams, want):
        assert_logprobs_close(s.logprobs, w.logprobs)


@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1)])
def test_gemma2_kv_groups_through_tp_match_colocated(ray_session, tmp_path, ptp, dtp):
    """Tiny Gemma 2 (layers sliding 24, global, sliding 24: three KV groups, a transfer each, the
    sliding ones cut to the window) through P tp=1 -> D tp=2 and P tp=2 -> D tp=1: every decode
    rank expects each group's heads from the right prefill ranks; greedy tokens equal colocated.
    With them an n = 3 request (60 tokens: its choices fork, copying a partial block in each group
    on every decode rank): each choice equals colocated too."""
    kind, switches = FAMILIES["gemma2"]
    path = str(save_tiny(tmp_path / "gemma2", kind, seed=5, **switches))
    prompts = random_prompts(4, [7, 60, 140], seed=ptp * 10 + dtp)
    with Cluster(spec_for(path, prefill_tp=ptp, decode_tp=dtp), log_level="WARNING") as c:
        got = checked(c.generate(prompts + [prompts[1]], [GREEDY] * 4 + [replace(GREEDY, n=3)], timeout_s=120))
        c.assert_no_leaks()
    want = colocated_tokens(path, prompts)
    assert got == want + [want[1]] * 3


def test_pinned_rank_runs_on_its_own_core(ray_session, tiny_path):
    """cpus_per_rank 1 with one reserved core: the colocated rank's every thread runs on the second
    usable core at nice 0, its one intra-op thread matches, and it serves what it serves unpinned;
    its slot is free again once the cluster is gone."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 usable cores")
    prompts = random_prompts(3, [9, 40], seed=5)
    with Cluster(spec_for(tiny_path, mode="colocated", cpus_per_rank=1, num_threads=None), log_level="WARNING") as c:
        got = checked(c.generate(prompts, GREEDY, timeout_s=120))
        (inst,) = c.instances.values()
        cpu = inst.placements[0].cpu
        assert (cpu["cpus"], cpu["niceness"], cpu["intraop_threads"]) == (str(cpus[1]), 0, 1), cpu
        assert c.controller.planner.core_slots._held == {inst.node_id: {inst.instance_id: [0]}}
    assert c.controller.planner.core_slots._held[inst.node_id] == {}
    assert got == colocated_tokens(tiny_path, prompts)


def test_no_room_fails_fast_and_leaves_nothing(ray_session, tmp_path):
    """An instance no node can hold (tp=9 on an 8-CPU Ray, of a model whose 9 heads it splits)
    fails at once with a one-line error naming the role and TP size (not after the 120 s
    placement wait); nothing it reserved is left behind."""
    path = str(save_tiny_llama(tmp_path / "nine", hidden_size=144, intermediate_size=288, num_attention_heads=9,
                               num_key_value_heads=3))
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"no Ray node has room for a decode instance \(tp=9") as exc:
        Cluster(spec_for(path, decode_tp=9)).start()
    assert time.monotonic() - start < 60 and "\n" not in str(exc.value)
    deadline = time.monotonic() + 10  # prefill-0 started first: its group and actor are gone again
    while any(pg["state"] != "REMOVED" for pg in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, ray.util.placement_group_table()
        time.sleep(0.1)


def test_killed_decode_before_first_token_finishes_elsewhere(ray_session, tiny_path):
    """Kill the decode instance a request was reserved on, right after placement: the request
    completes on the other decode instance with the same tokens."""
    prompt = random_prompts(1, [200], seed=7)[0]
    with Cluster(spec_for(tiny_path, num_decode=2, max_num_batched_tokens=16)) as c:
        stream = c.submit("victim", prompt, GREEDY)
        tracked = next(t for t in c.router._by_attempt.values() if t.request_id == "victim")
        doomed = tracked.decode_id
        c.kill_instance(doomed)
        got = checked([stream.result(timeout=120)])
        assert c.router.stats["retries"] >= 1
        assert doomed not in c.instances or not c.instances[doomed].client.info.healthy  # replaced, or about to be
        c.assert_no_leaks()
    assert got == colocated_tokens(tiny_path, [prompt])


def test_spans_reach_an_otlp_receiver_from_every_process(ray_session, tiny_path):
    """With an OTLP endpoint in the spec, a request's spans reach it over OTLP/HTTP (protobuf decoded
    here) from three processes under their service names: the router's (this process), the prefill
    rank actor's and the decode rank actor's, all in the request's trace, the instances' under the
    attempt whose traceparent crossed the Ray call, the decode's receive under the prefill's transfer
    (whose traceparent crossed the KV control channel)."""
    receiver = OTLPReceiver()
    try:
        with Cluster(spec_for(tiny_path, otlp_traces_endpoint=receiver.url), log_level="WARNING") as c:
            root = tracing.start("gateway", "request", None)
            checked([c.submit("traced", random_prompts(1, [30], seed=3)[0], GREEDY,
                              trace=tracing.context_of(root)).result(timeout=60)])
            root.end()
            trace_id = f"{root.get_span_context().trace_id:032x}"
            deadline = time.monotonic() + 60  # each process sends every second (tracing.EXPORT_EVERY_MS)
            while len({s.service for s in receiver.spans if s.trace_id == trace_id}) < 3 \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        tracing.configure(None)
        receiver.close()
    spans = {s.name: s for s in receiver.spans if s.trace_id == trace_id}
    assert {name: s.service for name, s in spans.items() if name != "request"} == {
        "router.queue": "pdserve-gateway", "router.attempt": "pdserve-gateway",
        "prefill.queue": "pdserve-prefill", "prefill.compute": "pdserve-prefill", "kv.transfer": "pdserve-prefill",
        "decode.kv_wait": "pdserve-decode", "kv.receive": "pdserve-decode", "decode": "pdserve-decode"}
    attempt = spans["router.attempt"].span_id
    assert {spans[n].parent_id for n in ("prefill.queue", "prefill.compute", "kv.transfer", "decode.kv_wait",
                                         "decode")} == {attempt}
    assert spans["kv.receive"].parent_id == spans["kv.transfer"].span_id


def test_add_and_remove_instances_while_serving(ray_session, tiny_path):
    """Add a decode instance and remove the original one with requests in flight: all finish
    with the colocated tokens."""
    prompts = random_prompts(8, [20, 60], seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(tiny_path)) as c:
        streams = [c.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
        new = c.add_instance("decode")
        time.sleep(0.2)
        c.remove_instance("decode-0")
        got = checked([s.result(timeout=120) for s in streams])
        more = checked(c.generate(prompts[:2], params, timeout_s=120))
        assert set(c.instances) == {"prefill-0", new}
        c.assert_no_leaks()
    ref = colocated_tokens(tiny_path, prompts, params)
    assert got == ref and more == ref[:2]


def test_ray_actuator_1p1d_to_2p2d_and_back_under_load(ray_session, tiny_path):
    """Requests keep arriving while the RayActuator grows the pools to 2P2D (the new instances
    take work) and shrinks them back to 1P1D by draining: every request finishes with the
    colocated tokens, none needed a retry (drained, not killed), every allocator ends full."""
    prompts = random_prompts(10, [12, 40, 90], seed=12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(tiny_path)) as c:
        act = RayActuator(c, drain_timeout_s=60)
        assert act.current() == PoolSizes(1, 1)
        streams, stop = [], threading.Event()

        def load():  # a request every 0.1 s until the pools are back to 1P1D
            while not stop.is_set():
                i = len(streams)
                streams.append((i % len(prompts), c.submit(f"load-{i}", prompts[i % len(prompts)], params)))
                time.sleep(0.1)
        feeder = threading.Thread(target=load)
        feeder.start()
        act.apply(PoolSizes(2, 2))
        assert act.current() == PoolSizes(2, 2)
        new = {i.instance_id: i.client.info for i in c.instances.values() if i.instance_id.endswith("-1")}
        deadline = time.monotonic() + 60
        while not (new["prefill-1"].load.figures.get("prefill_tokens_computed") and new["decode-1"].load.figures.get("decode_steps")):
            assert time.monotonic() < deadline, "the added instances never got work"
            time.sleep(0.1)
        act.apply(PoolSizes(1, 1))
        assert act.current() == PoolSizes(1, 1) and len(c.instances) == 2
        stop.set()
        feeder.join()
        got = [(i, s) for i, s in ((i, s.result(timeout=120)) for i, s in streams)]
        assert [s.error for _, s in got] == [None] * len(got) and len(got) > 20
        assert c.router.stats["retries"] == 0
        c.assert_no_leaks()
    want = colocated_tokens(tiny_path, prompts, params)
    assert [s.token_ids for _, s in got] == [want[i] for i, _ in got]


@pytest.fixture(scope="module")
def smollm2_heads_path(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's attention geometry: 9 query / 3 KV heads of 64 (hidden 576),
    tied embeddings, rope theta 1e5; 2 layers and a 384-token vocabulary in place of its 30 and 49152.
    What a rank holds under tp 3 (3 query heads, 1 KV head, a third of the tied vocabulary) is what it
    holds of SmolLM2; loading four SmolLM2 ranks and two references per case was most of the time
    (both cases: 106 s with SmolLM2, 28 s with this, on 2 loaded cores)."""
    return str(save_tiny_llama(tmp_path_factory.mktemp("smollm2_heads"), seed=9, vocab_size=384, hidden_size=576,
                               intermediate_size=384, num_hidden_layers=2, num_attention_heads=9,
                               num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True))


@pytest.mark.parametrize("ptp,dtp", [(1, 3), (3, 1)])
def test_smollm2_heterogeneous_tp(ray_session, smollm2_heads_path, ptp, dtp):
    """SmolLM2's heads (9 query / 3 KV: tp 2 cannot split them, so tp 3) through P tp=1 -> D tp=3 and
    P tp=3 -> D tp=1 equals colocated, fp32 (a prompt of 7 tokens and one of 90 across blocks of 16)."""
    prompts = [[1, 204, 358, 282, 49, 314, 2], random_prompts(1, [90], vocab=384, seed=2)[0]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(smollm2_heads_path, prefill_tp=ptp, decode_tp=dtp, num_kv_blocks=64, block_size=16)) as c:
        got = checked(c.generate(prompts, params, timeout_s=240))
        c.assert_no_leaks()
    assert got == colocated_tokens(smollm2_heads_path, prompts, params)


def test_a_tp2_pair_swaps_roles_by_two_flips_under_load(ray_session, tiny_path):
    """1P1D, both TP 2 on Ray, placed as on shared worker pods (every rank holds a unit of the node's
    `worker` resource, the chart's workerPods shared): the prefill instance flips to decode, then the
    decode one to prefill, while requests stream (between the flips, prompts are computed on a decode
    instance); every request equals colocated, the pools are swapped, and the flipped ranks (followers
    rebuilt when rank 0 released them) serve the next requests."""
    prompts = random_prompts(12, [20, 60], seed=12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Cluster(spec_for(tiny_path, prefill_tp=2, decode_tp=2, ray_resources=True, worker_pods="shared")) as c:
        import ray
        assert ray.available_resources().get("worker", 0) == 8 - 4  # the four ranks' units
        streams = [c.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
        first = c.flip_instance("prefill-0", "decode")
        second = c.flip_instance("decode-0", "prefill")
        got = checked([s.result(timeout=120) for s in streams])
        more = checked(c.generate(prompts[:4], params, timeout_s=120))
        assert {i: inst.role for i, inst in c.instances.items()} == {"prefill-0": "decode", "decode-0": "prefill"}
        assert set(c.router.prefill) == {"decode-0"} and set(c.router.decode) == {"prefill-0"}
        assert c.state.get("prefill-0").role == "decode" and c.state.get("prefill-0").health == "healthy"
        c.assert_no_leaks()
    ref = colocated_tokens(tiny_path, prompts, params)
    assert got == ref and more == ref[:4]
    assert first["rebuild_s"] < 30 and second["rebuild_s"] < 30


def test_a_token_outside_the_vocabulary_is_refused_and_the_instances_live(ray_session, tiny_path):
    """Through the router (no gateway in front to check it): a prompt id past the tiny model's 256 is a
    bad request ending its stream, not an embedding lookup that would take the instance's process down."""
    with Cluster(spec_for(tiny_path)) as c:
        bad = c.submit("bad", [1, 2, 300], GREEDY).result(timeout=60)
        assert bad.finish_reason == "error" and "prompt token ids must be in [0, 256)" in bad.error
        assert checked(c.generate([[1, 2, 3]], GREEDY, timeout_s=60)) and c.router.stats["instance_deaths"] == 0
