"""The disk tier's files (engine/runner/disk_tier.py): a block written from a host slot comes back
equal into another; a corrupted, truncated or foreign file, or one of another KV format, is refused
(counted) and forgotten, never copied into a slot; the directory is bounded, least recently used
first; a directory that cannot be written degrades to loads only, and a full one stops writes, with
one log line and no exception."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine.runner import disk_tier
from engine.runner.disk_tier import DiskTier, identity_of

KEY, OTHER = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321


class Slots:
    """A host arena's slots: two KV views (K and V stand-ins) of 4 slots."""

    def __init__(self, dtype=torch.float32):
        self.views = [torch.zeros(4, 2, 8, 3, dtype=dtype), torch.zeros(4, 2, 8, 3, dtype=dtype)]

    def __call__(self, slot: int) -> list[torch.Tensor]:
        return [v[slot] for v in self.views]

    def fill(self, slot: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        for v in self.views:
            v[slot] = torch.randn(v.shape[1:], generator=g).to(v.dtype)
        return [v[slot].clone() for v in self.views]


def tier(path: Path, slots: Slots, identity: str = "a" * 16, capacity: int = 1 << 20) -> DiskTier:
    return DiskTier(path, identity, capacity, slots)


def test_a_spilled_block_comes_back_equal_and_a_new_tier_on_the_directory_finds_it(tmp_path):
    slots = Slots()
    want = slots.fill(0, seed=1)
    disk = tier(tmp_path, slots)
    assert disk.spill(KEY, 0) and disk.has(KEY) and not disk.has(OTHER)
    assert disk.load(KEY, 2) and all(torch.equal(a, b) for a, b in zip(slots(2), want))
    again = tier(tmp_path, Slots())  # a restarted instance, or another one on a shared volume
    assert again.num_blocks == 1 and again.load(KEY, 1)
    assert all(torch.equal(a, b) for a, b in zip(again.slot_views(1), want))
    assert disk.stats["spilled_blocks"] == 1 and disk.stats["loaded_blocks"] == 1


def test_a_pool_block_is_written_as_a_slot_would_be_and_read_back_into_a_slot(tmp_path):
    """spill_block: a block whose host copy is still queued goes to disk from the pool (its K and V
    views share the pool's storage) and comes back into a slot as one spilled from a slot does."""
    slots = Slots()
    pool = torch.randn(2, 5, 2, 8, 3)  # (K and V, blocks, ...) as one tensor
    disk = DiskTier(tmp_path, "a" * 16, 1 << 20, slots, lambda block: [pool[0][block], pool[1][block]])
    assert disk.spill_block(KEY, 3) and disk.load(KEY, 1)
    assert torch.equal(slots(1)[0], pool[0][3]) and torch.equal(slots(1)[1], pool[1][3])


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


@pytest.mark.parametrize("damage", [_corrupt, _truncate], ids=["corrupted", "truncated"])
def test_a_damaged_file_is_refused_never_loaded(tmp_path, damage, caplog):
    slots = Slots()
    slots.fill(0, seed=1)
    disk = tier(tmp_path, slots)
    assert disk.spill(KEY, 0)
    damage(next(disk.dir.glob("*.safetensors")))
    with caplog.at_level(logging.WARNING, logger="engine.runner.disk_tier"):
        assert not tier(tmp_path, slots).load(KEY, 3)
    assert torch.count_nonzero(slots.views[0][3]) == 0  # the slot was not written
    assert "refused" in caplog.text and "computed again" in caplog.text


def test_a_foreign_file_is_refused_another_model_or_kv_format(tmp_path):
    """A file of another identity (model or KV format) put under this one's name, and a file of this
    identity whose views are not these, are refused; identities differ with the model's bytes and
    with the KV dtype."""
    theirs = tier(tmp_path, Slots(), identity="b" * 16)
    theirs.slot_views.fill(0, seed=2)
    assert theirs.spill(KEY, 0)
    mine = tier(tmp_path, Slots())
    shutil.copy(theirs.dir / f"{KEY:016x}.safetensors", mine.dir)
    assert not mine.load(KEY, 0) and mine.stats["refused_blocks"] == 1 and not mine.has(KEY)
    bf16 = tier(tmp_path / "x", Slots(torch.bfloat16))
    bf16.slot_views.fill(0, seed=2)
    assert bf16.spill(KEY, 0)
    fp32 = tier(tmp_path / "x", Slots())  # the same identity claimed, other views
    assert not fp32.load(KEY, 0) and fp32.stats["refused_blocks"] == 1
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"\x01" * 4096), b.write_bytes(b"\x02" * 4096)  # same size, other bytes
    views = Slots().views
    assert identity_of(a, views, 16, "torch") != identity_of(b, views, 16, "torch")
    assert identity_of(a, views, 16, "torch") != identity_of(a, Slots(torch.bfloat16).views, 16, "torch")
    assert identity_of(a, views, 16, "torch") == identity_of(a, Slots().views, 16, "torch")


def test_the_directory_is_bounded_least_recently_used_first(tmp_path):
    slots = Slots()
    for s in range(3):
        slots.fill(s, seed=s)
    probe = tier(tmp_path / "probe", slots)
    probe.spill(1, 0)
    size = int(probe.figures()["kv_disk_tier_bytes"])
    disk = tier(tmp_path, slots, capacity=2 * size)
    assert disk.spill(1, 0) and disk.spill(2, 1)
    assert disk.load(1, 3)  # 1 is the most recently used now
    assert disk.spill(3, 2) and disk.num_blocks == 2 and disk.has(1) and not disk.has(2)
    assert disk.stats["deleted_blocks"] == 1 and len(list(disk.dir.glob("*.safetensors"))) == 2


def test_a_directory_it_cannot_write_serves_loads_and_a_full_one_stops_writes(tmp_path, monkeypatch, caplog):
    slots = Slots()
    slots.fill(0, seed=1)
    assert tier(tmp_path, slots).spill(KEY, 0)
    monkeypatch.setattr(disk_tier.os, "access", lambda path, mode: False)  # as a read-only mount (root writes any)
    with caplog.at_level(logging.WARNING, logger="engine.runner.disk_tier"):
        ro = tier(tmp_path, slots)
    assert not ro.writable and "writes stop, loads go on" in caplog.text
    assert ro.load(KEY, 1) and not ro.spill(OTHER, 0)
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_tier, "save_file", full)
    disk = tier(tmp_path, slots)
    assert not disk.spill(OTHER, 0) and not disk.writable and disk.stats["write_failures"] == 1
    assert not disk.spill(OTHER + 1, 0) and disk.stats["write_failures"] == 1  # no retry, one line
    assert disk.load(KEY, 2) and not list(disk.dir.glob(".*.tmp"))
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert not tier(blocked, slots).writable  # cannot make the directory: nothing raises
