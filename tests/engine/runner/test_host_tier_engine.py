"""A host tier under a colocated engine's pool (engine/core/host_tier.py, engine/runner/host_arena.py):
a conversation's blocks evicted by other prompts spill to host memory and come back for its next
turn, and the next turn's greedy tokens and top logprobs equal, bit for bit (the batch-invariant
mode), a run that never spilled (a pool that holds everything) and one without any cache."""
from __future__ import annotations

import pytest

from tests.helpers import engine_config, generate_steps, make_hf_tiny_llama, random_prompts, tiny_engine

pytestmark = pytest.mark.timeout(300)
TURN1 = random_prompts(1, [64], seed=41)[0]  # 4 blocks of 16
OTHERS = random_prompts(3, [64], seed=42)  # each evicts what the small pool held
MAX_TOKENS = 6


def conversation(engine) -> tuple[list, int]:
    """Turn 1, three other prompts, then turn 2 (turn 1, its reply, a new message): turn 2's
    (tokens, logprobs) and how many of its prompt tokens were not computed."""
    (first, _, _), = generate_steps(engine, [TURN1], MAX_TOKENS)
    for other in OTHERS:
        generate_steps(engine, [other], MAX_TOKENS)
    (tokens, logprobs, cached), = generate_steps(engine, [TURN1 + first + [5] * 10], MAX_TOKENS)
    engine.kv.assert_no_leaks()
    return (tokens, logprobs), cached


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_tiny_llama(seed=3)


def engine_of(hf_model, **knobs):
    return tiny_engine(hf_model, **{"num_blocks": 8, "block_size": 16, "batch_invariant": True,
                                    "attention_backend": "torch", **knobs})


@pytest.mark.parametrize("gib", [1e-3, 4e-5])  # room for every evicted block; for a few (the oldest dropped)
def test_the_next_turn_comes_back_from_host_memory_and_equals_a_run_that_never_spilled(hf_model, gib):
    roomy, _ = conversation(engine_of(hf_model, num_blocks=64))
    uncached, none = conversation(engine_of(hf_model, prefix_caching=False))
    engine = engine_of(hf_model, host_tier_gib=gib)
    got, cached = conversation(engine)
    assert got == roomy == uncached and none == 0
    tier, arena = engine.kv.tier, engine.runner.host_arena
    if arena.num_slots >= 16:
        assert cached == 64 and tier.stats["reloaded_blocks"] == 4 and tier.stats["dropped_blocks"] == 0
        assert arena.figures()["kv_host_tier_reload_seconds"] > 0  # what the router weighs the tier by
    else:  # the oldest blocks, turn 1's, were dropped: recomputed
        assert tier.stats["dropped_blocks"] > 0 and tier.num_blocks == arena.num_slots


def test_without_a_tier_the_next_turn_is_computed_again(hf_model):
    engine = engine_of(hf_model)
    _, cached = conversation(engine)
    assert engine.kv.tier is None and engine.runner.host_arena is None and cached == 0


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    """The tiny model as files (the disk tier names its blocks by them)."""
    folder = tmp_path_factory.mktemp("disk") / "tiny"
    hf_model.save_pretrained(folder)
    return folder


def files_engine(folder, **knobs):
    from decode_worker.engine import ColocatedEngine
    from engine.runner.model_runner import ModelRunner
    cfg = engine_config(**{"model": str(folder), "num_blocks": 8, "block_size": 16, "batch_invariant": True,
                           "attention_backend": "torch", **knobs})
    return ColocatedEngine(cfg, runner=ModelRunner(cfg))  # token ids only: the folder has no tokenizer


def test_the_next_turn_comes_back_from_disk_then_a_damaged_file_is_recomputed(hf_model, saved, tmp_path):
    """A host tier of 5 slots under a disk tier: the other prompts' blocks push turn 1's on to disk,
    and they come back from there (equal, bit for bit, to a pool that held everything); a new engine
    on the same directory (a restart) serves turn 2 from it without turn 1; with the files
    corrupted, turn 2 is computed and still equal."""
    roomy, _ = conversation(files_engine(saved, num_blocks=64))
    knobs = {"host_tier_gib": 6e-5, "disk_tier_gib": 0.01, "disk_tier_dir": str(tmp_path)}
    engine = files_engine(saved, **knobs)
    assert 4 <= engine.runner.host_arena.num_slots < 4 * len(OTHERS) and engine.kv.tier.disk is not None
    got, cached = conversation(engine)
    disk = engine.kv.tier.disk
    assert got == roomy and cached == 64 and disk.stats["loaded_blocks"] >= 4, disk.stats
    assert disk.figures()["kv_disk_tier_read_seconds"] > 0 and disk.files.num_staged == 0
    (first, _, _), = generate_steps(files_engine(saved, num_blocks=64), [TURN1], MAX_TOKENS)
    turn2 = TURN1 + first + [5] * 10
    restarted = files_engine(saved, **knobs)
    (tokens, logprobs, cached), = generate_steps(restarted, [turn2], MAX_TOKENS)
    assert (tokens, logprobs) == roomy and cached == 64
    for path in restarted.runner.host_arena.files.dir.glob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    damaged = files_engine(saved, **knobs)
    (tokens, logprobs, cached), = generate_steps(damaged, [turn2], MAX_TOKENS)
    assert (tokens, logprobs) == roomy and cached == 0
    assert damaged.kv.tier.disk.stats["refused_blocks"] >= 1
    damaged.kv.assert_no_leaks()


def test_a_prompt_gets_more_blocks_back_from_disk_than_the_host_tier_has_slots(hf_model, saved, tmp_path):
    """A host tier of 2 slots over a disk tier: turn 2's 4 blocks of turn 1 all come back (2 through
    slots, 2 read straight into their pool blocks), equal, bit for bit, to a pool that held them."""
    roomy, _ = conversation(files_engine(saved, num_blocks=64))
    engine = files_engine(saved, host_tier_gib=3e-5, disk_tier_gib=0.01, disk_tier_dir=str(tmp_path))
    assert engine.runner.host_arena.num_slots < 4
    got, cached = conversation(engine)
    assert got == roomy and cached == 64, engine.kv.tier.disk.stats


def test_a_turn_waiting_for_its_disk_reads_lets_another_request_run_meanwhile(hf_model, saved, tmp_path, monkeypatch):
    """The reads are held back until another prompt has decoded 3 tokens: the turn waits (nothing of
    it computed) while that prompt's steps run, then takes its blocks from disk, and its tokens equal
    a pool that held them."""
    import threading

    from engine.runner.disk_files import DiskFiles
    from engine.sample.sampling import SamplingParams
    roomy, _ = conversation(files_engine(saved, num_blocks=64))
    engine = files_engine(saved, host_tier_gib=3e-5, disk_tier_gib=0.01, disk_tier_dir=str(tmp_path))
    (first, _, _), = generate_steps(engine, [TURN1], MAX_TOKENS)
    for other in OTHERS:
        generate_steps(engine, [other], MAX_TOKENS)
    release, read = threading.Event(), DiskFiles.read
    monkeypatch.setattr(DiskFiles, "read", lambda self, key: (release.wait(60), read(self, key))[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    turn2 = engine.add_request("turn2", TURN1 + first + [5] * 10, params)
    other = engine.add_request("other", random_prompts(1, [20], seed=43)[0], params)
    while len(other.output_token_ids) < 3:
        engine.step()
        assert turn2.num_computed_tokens == 0 and engine.kv.tier.disk._answers  # waiting, its reads in flight
    release.set()
    while engine.has_unfinished():
        engine.step()
    assert (turn2.output_token_ids, [e["logprobs"] for e in turn2.output_extras]) == roomy
    assert turn2.num_cached_tokens == 64 and engine.kv.tier.disk.stats["loaded_blocks"] >= 4
    engine.kv.assert_no_leaks()


@pytest.fixture(scope="module")
def saved_gemma2(tmp_path_factory):
    """A tiny Gemma 2 as files: sliding and global layers alternating, several KV groups."""
    from tests.helpers import FAMILIES, make_hf_tiny
    kind, switches = FAMILIES["gemma2"]
    folder = tmp_path_factory.mktemp("gemma2") / "tiny"
    make_hf_tiny(kind, seed=3, **switches).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tiers", [{"host_tier_gib": 1e-2},
                                   {"host_tier_gib": 4e-5, "disk_tier_gib": 0.01}], ids=["host", "host+disk"])
def test_a_model_of_several_kv_groups_gets_the_next_turn_back_from_its_tiers(saved_gemma2, tmp_path, tiers):
    """Gemma 2's sliding and global layers are KV groups: each group's blocks of turn 1 leave the
    pool for the host tier (and its disk) and come back, every group's block of a position together;
    turn 2's tokens equal, bit for bit, a pool that held them and a run without any cache."""
    roomy, _ = conversation(files_engine(saved_gemma2, num_blocks=64))
    uncached, _ = conversation(files_engine(saved_gemma2, num_blocks=16, prefix_caching=False))
    knobs = {"disk_tier_dir": str(tmp_path), **tiers}
    engine = files_engine(saved_gemma2, num_blocks=16, **knobs)
    num_groups = engine.kv.tier.num_groups
    assert num_groups == len(engine.kv.windows) > 1  # (its 3 layers: a group each)
    got, cached = conversation(engine)
    assert got == roomy == uncached and cached == 64, engine.kv.tier.figures()
    assert engine.kv.tier.stats["reloaded_blocks"] >= 4 * num_groups  # 4 positions, every group's
    if "disk_tier_gib" in tiers:
        assert engine.runner.host_arena.num_slots < 4 * num_groups and engine.kv.tier.disk.stats["loaded_blocks"] >= 1
