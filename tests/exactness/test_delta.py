"""Delta transfer (issue 51): the second turn of a conversation whose first turn's KV the decode
instance's prefix cache holds ships only the KV after it, and its output equals colocated serving's
bit for bit (the batch-invariant mode), whatever the layout and block size.

The first turn ships its whole prompt: the KV bytes per prompt token it received are the unit.
The decode instance computed the first turn's output tokens but the last, so it holds the full
blocks of those (len(turn 1) + MAX_TOKENS - 1) tokens; the second turn ships exactly the rest."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.control.cluster import Cluster
from engine.core.request import SamplingParams
from engine.loading.loader import hf_model_config
from tests.exactness.matrix import LAYOUTS, Case, mismatches, spec_of
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)
TURN1 = random_prompts(1, [40], seed=21)[0]
NEW = random_prompts(1, [13], seed=22)[0]  # the second turn's new user message
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def _generate(cluster: Cluster, prompt: list[int]):
    (stream,) = cluster.generate([prompt], GREEDY, timeout_s=120)
    assert stream.error is None, stream.error
    return stream


def _decode_load(cluster: Cluster) -> dict:
    (decode,) = [i for i in cluster.instances.values() if i.role != "prefill"]
    return decode.client.load()


def conversation(case: Case, model: str, counts: dict | None = None, between: tuple = (), **overrides):
    """Two turns through a cluster of the case's spec, the prompts `between` them served in between:
    {"turn1": ..., "turn2": ...} as the matrix's outputs, and in `counts` the decode instance's KV
    bytes received and prompt tokens reused per turn, and the blocks every host tier reloaded and
    every disk tier read back."""
    cluster = Cluster(spec_of(case, model, **overrides), use_ray=case.needs_ray).start()
    try:
        first = _generate(cluster, TURN1)
        after1 = _decode_load(cluster)
        for prompt in between:
            _generate(cluster, prompt)
        before2 = _decode_load(cluster)
        second = _generate(cluster, TURN1 + first.token_ids + NEW)
        after2 = _decode_load(cluster)
        loads = [i.client.load() for i in cluster.instances.values()]
        reloaded = sum(load.get("kv_host_tier_reloaded_blocks", 0) for load in loads)
        from_disk = sum(load.get("kv_disk_tier_loaded_blocks", 0) for load in loads)
        cluster.assert_no_leaks()
    finally:
        cluster.shutdown()
    if counts is not None:
        for key in ("kv_bytes_received", "kv_reused_prompt_tokens"):
            counts[key] = (after1.get(key, 0), after2.get(key, 0) - before2.get(key, 0))
        counts["tier_reloaded_blocks"], counts["disk_loaded_blocks"] = reloaded, from_disk
    return {"turn1": [(first.token_ids, first.logprobs)], "turn2": [(second.token_ids, second.logprobs)]}


@pytest.fixture(scope="module")
def colocated(model):
    return conversation(Case(), model)


@pytest.mark.parametrize("layout,block_size", [("1P1D", 8), ("P1-D3", 16)])
def test_the_second_turn_ships_only_what_the_decode_instance_lacks(model, colocated, layout, block_size, request):
    case = Case(layout=layout, block_size=block_size, prefix="hit", n3=False, structured=False)
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    assert mismatches(conversation(case, model, counts), colocated) == []
    (bytes1, bytes2), (reused1, reused2) = counts["kv_bytes_received"], counts["kv_reused_prompt_tokens"]
    held = (len(TURN1) + MAX_TOKENS - 1) // block_size * block_size
    assert reused1 == 0 and reused2 == held > 0
    per_token = bytes1 / len(TURN1)
    assert bytes2 == per_token * (len(TURN1) + MAX_TOKENS + len(NEW) - held), (bytes1, bytes2, held)


@pytest.mark.parametrize("prefix,kv_delta", [("miss", True), ("hit", False)], ids=["no-prefix-cache", "no-kv-delta"])
def test_without_delta_the_whole_prompt_ships(model, colocated, prefix, kv_delta):
    """The controls: prefix caching off, or on with --no-kv-delta: the second turn ships every prompt token."""
    case = Case(layout="1P1D", block_size=8, prefix=prefix, n3=False, structured=False)
    counts = {}
    assert mismatches(conversation(case, model, counts, kv_delta=kv_delta), colocated) == []
    (bytes1, bytes2), (_, reused2) = counts["kv_bytes_received"], counts["kv_reused_prompt_tokens"]
    assert reused2 == 0 and bytes2 == bytes1 / len(TURN1) * (len(TURN1) + MAX_TOKENS + len(NEW))


@pytest.mark.parametrize("layout", ["1P1D", "P1-D3"])
def test_the_host_tiers_serve_the_second_turn_after_other_prompts_evicted_it(model, colocated, layout, request):
    """Pools of 11 blocks of 8 tokens: two other prompts between the turns evict the first turn's
    blocks from both pools. The prefill instance reloads them from its host tier; the decode
    instance, whose tier writes through (its reservations evict what a transfer writes at once),
    reloads them from its own (each of its TP ranks, its heads), so only what it never held ships,
    as when its pool kept them; the output equals colocated bit for bit."""
    case = Case(layout=layout, block_size=8, prefix="hit", n3=False, structured=False)
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    between = tuple(random_prompts(2, [80], seed=23))
    got = conversation(case, model, counts, between, num_kv_blocks=12, kv_host_tier_gib=0.02)
    assert mismatches(got, colocated) == []
    (bytes1, bytes2), (_, reused2) = counts["kv_bytes_received"], counts["kv_reused_prompt_tokens"]
    held = (len(TURN1) + MAX_TOKENS - 1) // 8 * 8
    assert reused2 == held and bytes2 == bytes1 / len(TURN1) * (len(TURN1) + MAX_TOKENS + len(NEW) - held), counts
    assert counts["tier_reloaded_blocks"] >= 2 * (len(TURN1) // 8), counts  # on each side


@pytest.mark.parametrize("layout", ["1P1D", "P3-D1"])
def test_a_prefill_instance_reads_the_first_turn_back_from_its_disk_tier(model, colocated, tmp_path, layout, request):
    """Host tiers of six blocks (the first turn's five fit; the 22 of the prompts between the turns
    do not) over disk tiers: those prompts push the first turn's blocks through the prefill
    instance's host tier on to its disk (with TP, each rank its heads' files); the second turn waits
    while every rank reads them back (the decode instance, which reads no disk at reservation, gets
    them shipped), and the output equals colocated bit for bit."""
    case = Case(layout=layout, block_size=8, prefix="hit", n3=False, structured=False)
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    between = tuple(random_prompts(2, [80], seed=23))
    cfg = hf_model_config(Path(model))
    heads = max(1, cfg.num_kv_heads // LAYOUTS[layout][3])  # a prefill rank's (its tier is per rank)
    six_blocks = 6.5 * 8 * cfg.num_layers * 2 * heads * cfg.head_dim * 4 / 2**30  # fp32 KV
    got = conversation(case, model, counts, between, num_kv_blocks=12, kv_host_tier_gib=six_blocks,
                       kv_disk_tier_gib=0.1, kv_disk_tier_dir=str(tmp_path))
    assert mismatches(got, colocated) == []
    assert counts["disk_loaded_blocks"] >= len(TURN1) // 8, counts
