"""The disk tier (engine/runner/disk_tier.py, disk_files.py) with the host tier's books over it
(engine/core/host_tier.py) and real arenas (engine/runner/host_arena.py), one per TP rank, each
writing its own files: a block spilled from a slot or straight from the pool comes back equal into
a new pool block; a prompt whose blocks are on disk waits while every rank reads them on its own
thread, then takes them; a rank that refuses its file (corrupted, truncated, foreign) makes the
block refused and recomputed, never loaded; the directory is bounded, least recently used first;
a directory that cannot be written serves loads, a full one stops writes, with one log line."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from engine.core.block_manager import KVCacheManager, block_hashes
from engine.core.host_tier import HostTier
from engine.core.request import Request
from engine.core.tier_copies import BLOCK, DELETE, SLOT
from engine.runner import disk_files
from engine.runner.disk_files import GONE, HEADER_BYTES, OK, DiskFiles, identity_of
from engine.runner.disk_tier import DiskTier
from engine.runner.host_arena import HostArena
from tests.engine.core.test_block_manager import prefill

A = list(range(10, 26))  # 16 tokens: 4 blocks of 4
B = list(range(100, 132))  # 32 tokens: 8 blocks, the whole pool
KEY, OTHER = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321


def rank_arena(tmp_path, rank: int, num_slots: int, num_blocks: int = 9, dtype=torch.float32) -> HostArena:
    """One rank's pool (each block's 2 values say which block and rank it is) and host arena, its
    files under a shard identity of its own."""
    pool = torch.zeros(1, num_blocks, 2, dtype=dtype)
    for b in range(num_blocks):
        pool[0, b] = torch.tensor([b, rank], dtype=dtype)
    arena = HostArena(pool, lambda slab: [slab], num_slots)
    arena.files = DiskFiles(tmp_path, f"shard{rank}", arena.slot_views, arena.block_views)
    return arena


def tiered(tmp_path, num_slots: int, num_ranks: int = 1, capacity: int = 1 << 20):
    mgr = KVCacheManager(num_blocks=9, block_size=4)
    arenas = [rank_arena(tmp_path, r, num_slots) for r in range(num_ranks)]
    mgr.tier = HostTier(num_slots, mgr.block_pool, DiskTier(arenas[0].files, capacity, num_ranks))
    return mgr, mgr.tier, arenas


def step(tier: HostTier, arenas: list[HostArena]):
    """Every rank makes the step's copies; then the ranks' reads are answered, all of them."""
    c = tier.take()
    for arena in arenas:
        arena.apply(c)
    for _ in range(200):
        if not tier.disk._answers:
            break
        tier.arrived([arena.poll_disk(wait_s=0.05) for arena in arenas])
    return c


def cached(mgr: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """A prompt computed and freed into the prefix cache; its blocks' ids."""
    req = Request(rid, tokens)
    assert prefill(mgr, req) is not None
    mgr.cache_blocks(req, len(tokens))
    ids = mgr.get_block_ids(rid)[0]
    mgr.free(req)
    return ids


def spilled(tmp_path, num_ranks: int = 1):
    """a's 4 blocks pushed out of a 2-slot host tier on to disk by b's and c's."""
    mgr, tier, arenas = tiered(tmp_path, 2, num_ranks)
    a_blocks = cached(mgr, "a", A)
    cached(mgr, "b", B)
    step(tier, arenas)
    cached(mgr, "c", list(range(200, 232)))
    step(tier, arenas)
    a = block_hashes(A, 4)
    assert all(tier.disk.has(k) for k in a) and not set(a) & set(tier._slots)
    return mgr, tier, arenas, a, a_blocks


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_prompt_waits_for_its_disk_reads_then_takes_them_from_every_rank(tmp_path, num_ranks):
    """More blocks than the host tier has slots come back: read on every rank's thread (staged, no
    slot taken), the prompt waiting meanwhile, then copied into its new blocks: each rank's own."""
    mgr, tier, arenas, a, a_blocks = spilled(tmp_path, num_ranks)
    again = Request("a2", A + [7])
    assert mgr.get_computed_blocks(again)[1] == 0
    assert tier.claim_for(mgr, again, 0) is None  # it waits: the reads go with the next step
    assert tier.busy and tier.claim_for(mgr, again, 0) is None
    c = step(tier, arenas)
    assert c.reads == a and c.poll and not tier.busy
    assert tier.disk.stats["loaded_blocks"] == 4 and all(arena.files.num_staged == 4 for arena in arenas)
    keys = tier.claim_for(mgr, again, 0)
    assert keys == a and mgr.allocate_slots(again, again.num_tokens) is not None
    tier.reload_for(mgr, again, keys, 0)
    c = step(tier, arenas)
    blocks = mgr.get_block_ids("a2")[0][:4]
    assert c.loads == list(zip(a, blocks))
    for rank, arena in enumerate(arenas):
        assert arena.files.num_staged == 0
        got = arena.kv_cache[0][blocks]
        assert torch.equal(got, torch.tensor([[b, rank] for b in a_blocks], dtype=got.dtype))
    tier.release_copied()
    mgr.free(again)
    mgr.assert_no_leaks()


def test_a_waiting_prompt_that_leaves_lets_its_reads_go(tmp_path):
    """Aborted while its reads are in flight: what they staged is dropped on every rank."""
    mgr, tier, arenas, a, _ = spilled(tmp_path, 2)
    gone = Request("a2", A + [7])
    mgr.get_computed_blocks(gone)
    assert tier.claim_for(mgr, gone, 0) is None
    mgr.free(gone)
    tier.forget("a2")
    step(tier, arenas)  # the reads land ... and are let go
    c = step(tier, arenas)
    assert sorted(c.drops) == sorted(a) and all(arena.files.num_staged == 0 for arena in arenas)


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-40])


def _foreign(path):
    other = DiskFiles(path.parent.parent, "other", lambda s: [torch.ones(2)])
    other.write(int(path.stem, 16), [torch.ones(2)])
    shutil.copy(other.path(int(path.stem, 16)), path)


@pytest.mark.parametrize("damage", [_corrupt, _truncate, _foreign], ids=["corrupted", "truncated", "foreign"])
def test_a_block_one_rank_refuses_is_recomputed_never_loaded(tmp_path, damage, caplog):
    """Rank 1's file of a[1] damaged: a[1] is refused (counted, forgotten, rank 1 logs why), the
    other ranks' copies dropped, and the prompt takes a[0] alone: the rest is computed."""
    mgr, tier, arenas, a, _ = spilled(tmp_path, 2)
    damage(arenas[1].files.path(a[1]))
    again = Request("a2", A + [7])
    mgr.get_computed_blocks(again)
    assert tier.claim_for(mgr, again, 0) is None
    with caplog.at_level(logging.WARNING, logger="engine.runner.disk_files"):
        step(tier, arenas)
    assert "refused" in caplog.text and "computed again" in caplog.text
    assert tier.disk.stats["refused_blocks"] == 1 and not tier.disk.has(a[1])
    keys = tier.claim_for(mgr, again, 0)
    assert keys == a[:1]
    tier.release(keys)
    tier.forget("a2")
    mgr.free(again)
    c = step(tier, arenas)
    assert a[1] in c.drops and all(a[1] not in arena.files._staged for arena in arenas)


def test_under_a_full_tier_blocks_go_to_disk_from_the_slot_or_from_the_pool(tmp_path):
    """The slot a full tier takes back is written to disk by the step that overwrites it, first; one
    whose own copy is still queued has its block written from the pool (that copy cancelled); the
    index holds them at the disk level; a new instance on the directory finds them."""
    mgr, tier, arenas = tiered(tmp_path, 3)
    log = mgr.block_pool.events
    a = block_hashes(A, 4)
    a_blocks = cached(mgr, "a", A)
    cached(mgr, "b", B)  # a's 4 blocks into 3 slots in one step: a[0]'s slot taken back, from the pool
    c = step(tier, arenas)
    assert c.disk == [(BLOCK, a[0], a_blocks[0])] and sorted(b for b, _ in c.offloads) == a_blocks[1:]
    cached(mgr, "c", list(range(200, 208)))  # evicts 2 of b's blocks: a[1], a[2] leave their slots
    c = step(tier, arenas)
    assert [(op, k) for op, k, _ in c.disk] == [(SLOT, a[1]), (SLOT, a[2])]
    assert [log.level(k) for k in a] == ["d", "d", "d", "h"]
    again = DiskTier(DiskFiles(tmp_path, "shard0", arenas[0].slot_views), 1 << 20)
    assert again.num_blocks == 3 and all(again.has(k) for k in a[:3])


def test_the_directory_is_bounded_least_recently_used_first(tmp_path):
    files = DiskFiles(tmp_path, "a" * 16, lambda s: [torch.zeros(8)])
    books = DiskTier(files, 2 * (32 + HEADER_BYTES))
    assert books.spill(1, 0) and books.spill(2, 0)
    books.fetch([1])  # 1 is the most recently used now
    assert books.spill(3, 0) and books.num_blocks == 2 and books.has(1) and not books.has(2)
    ops, _, _, reads, _ = books.take()
    assert ops == [(SLOT, 1, 0), (SLOT, 2, 0), (SLOT, 3, 0), (DELETE, 2, 0)] and reads == [1]
    files.apply(ops)
    assert sorted(p.stem for p in files.dir.glob("*.safetensors")) == [f"{1:016x}", f"{3:016x}"]


def test_a_file_gone_meanwhile_is_forgotten_not_refused(tmp_path):
    files = DiskFiles(tmp_path, "a" * 16, lambda s: [torch.zeros(8)])
    books = DiskTier(files, 1 << 20)
    books.spill(KEY, 0)
    files.apply(books.take()[0])
    files.path(KEY).unlink()  # another instance sharing the directory deleted it
    books.fetch([KEY])
    files.start_reads(books.take()[3])
    assert files.poll(wait_s=5) == [(KEY, GONE)]
    assert books.arrived([[(KEY, GONE)]]) == [] and not books.has(KEY) and books.stats["refused_blocks"] == 0


def test_identities_differ_by_model_bytes_kv_format_and_shard(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"\x01" * 4096), b.write_bytes(b"\x02" * 4096)  # same size, other bytes
    views = [torch.zeros(4, 2, 8, 3)]
    one = identity_of(a, views, 16, "torch")
    assert one != identity_of(b, views, 16, "torch")
    assert one != identity_of(a, [torch.zeros(4, 2, 8, 3, dtype=torch.bfloat16)], 16, "torch")
    assert one == identity_of(a, [torch.zeros(4, 2, 8, 3)], 16, "torch") == identity_of(a, views, 16, "torch", (0, 1))
    assert len({one, identity_of(a, views, 16, "torch", (0, 2)), identity_of(a, views, 16, "torch", (1, 2))}) == 3


def test_a_file_of_other_views_under_this_identity_is_refused(tmp_path):
    bf16 = DiskFiles(tmp_path, "a" * 16, lambda s: [torch.zeros(8, dtype=torch.bfloat16)])
    assert bf16.write(KEY, [torch.ones(8, dtype=torch.bfloat16)])
    fp32 = DiskFiles(tmp_path, "a" * 16, lambda s: [torch.zeros(8)])
    assert fp32.read(KEY) == "not this KV format's views" and fp32.num_staged == 0
    assert bf16.read(KEY) == OK and torch.equal(bf16.take_staged(KEY)[0], torch.ones(8, dtype=torch.bfloat16))


def test_a_directory_it_cannot_write_serves_loads_and_a_full_one_stops_writes(tmp_path, monkeypatch, caplog):
    want = [torch.arange(8.0)]
    assert DiskFiles(tmp_path, "a" * 16, lambda s: want).write(KEY, want)
    monkeypatch.setattr(disk_files.os, "access", lambda path, mode: False)  # as a read-only mount (root writes any)
    with caplog.at_level(logging.WARNING, logger="engine.runner.disk_files"):
        ro = DiskFiles(tmp_path, "a" * 16, lambda s: want)
    assert not ro.writable and "writes stop, loads go on" in caplog.text
    books = DiskTier(ro, 1 << 20)
    assert not books.spill(OTHER, 0) and books.has(KEY) and ro.read(KEY) == OK
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_files, "save_file", full)
    files = DiskFiles(tmp_path, "a" * 16, lambda s: want)
    books = DiskTier(files, 1 << 20)
    assert books.spill(OTHER, 0)  # (written by the step)
    files.apply(books.take()[0])
    assert not files.writable and files.stats["write_failures"] == 1
    assert not books.spill(OTHER + 1, 0) and not list(files.dir.glob(".*.tmp"))  # no retry, one line
    assert files.read(KEY) == OK
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert not DiskFiles(blocked, "a" * 16, lambda s: want).writable  # cannot make the directory: nothing raises


def test_a_write_through_tier_reports_no_disk_level(tmp_path):
    """A decode instance's reservations claim host slots only: a block its tier spills to disk is
    removed from the index, not held at the disk level."""
    mgr, tier, arenas = tiered(tmp_path, 1)
    tier.write_through()
    log = mgr.block_pool.events
    cached(mgr, "a", A)
    step(tier, arenas), step(tier, arenas), tier.release_copied()  # a's 4 copies for the one slot: 3 to disk
    cached(mgr, "b", B)  # evicts a's blocks from the pool
    levels = [log.level(k) for k in block_hashes(A, 4)]
    assert tier.disk.num_blocks == 3 and levels.count("h") == 1 and levels.count(None) == 3, levels
