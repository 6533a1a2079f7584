"""What a decode rank reads of a prefill rank's KV pool over NIXL, and where it puts it.

A prefill rank describes its registered pool (`PoolShape`, in its hello); at `begin` it names the
slots of the part's tokens in it (`source` runs). The decode rank plans the part's reads once
(`plan_reads`), then reads each announced layer as byte ranges of the prefill's slab:

- direct, when both pools keep one block layout and block size, the part has all heads of both
  ranks and its tokens start a block on both sides: every block of the part is read straight into
  the decode block holding the same tokens (runs of consecutive blocks on both sides are one range
  each: one per plane and run in the torch layout, one per run in a block-contiguous one). The last
  block's slots past the prompt get the prefill's bytes there, which no decode step reads (they
  are the request's own, written before it decodes). No copy on either side.
- staged, otherwise (other TP sizes, block sizes or layouts, a sliding window's first tokens):
  the part's prefill blocks, whole, into a staging slab in the prefill's layout (`staging_blocks`
  blocks), gathered by token through that layout's views and scattered into the decode's slots,
  the heads the part carries (`local_slots`). Reads whole prefill rows: a decode rank of a larger
  TP group reads the heads of its peers too (the NHD pool keeps a token's heads together).

Byte offsets are within one layer's slab; a layer's slab starts `slab_bytes` after the one before.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from engine.attention import BLOCK_LAYOUTS

POOL_FIELDS = {"layout": str, "addr": int, "device_id": int, "mem": str, "num_slabs": int, "num_blocks": int,
               "block_size": int, "num_heads": int, "head_offset": int, "head_dim": int, "itemsize": int}


@dataclass(frozen=True)
class PoolShape:
    """A rank's KV pool (num_slabs, 2, num_blocks, block_size, num_heads, head_dim), contiguous, as
    registered: where it lies and how its blocks are laid out (BLOCK_LAYOUTS)."""
    layout: str
    addr: int
    device_id: int
    mem: str  # "DRAM" or "VRAM"
    num_slabs: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_offset: int  # global index of its first KV head
    head_dim: int
    itemsize: int

    @classmethod
    def of(cls, cache: torch.Tensor, layout: str, head_offset: int) -> PoolShape:
        assert cache.dim() == 6 and cache.is_contiguous(), cache.shape
        slabs, _, blocks, block_size, heads, head_dim = cache.shape
        return cls(layout, cache.data_ptr(), cache.device.index or 0, "VRAM" if cache.is_cuda else "DRAM", slabs,
                   blocks, block_size, heads, head_offset, head_dim, cache.element_size())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> PoolShape:
        """ValueError unless `d` is a map of exactly the fields, of their types, describing a pool
        whose layout is known here."""
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise ValueError(f"a pool description has fields {sorted(d) if isinstance(d, dict) else d!r}")
        for name, typ in POOL_FIELDS.items():
            if not isinstance(d[name], typ) or (typ is int and (isinstance(d[name], bool) or d[name] < 0)):
                raise ValueError(f"pool.{name} is {d[name]!r}")
        if d["layout"] not in BLOCK_LAYOUTS or d["mem"] not in ("DRAM", "VRAM"):
            raise ValueError(f"a pool in layout {d['layout']!r} in {d['mem']!r} memory is not readable here")
        if min(d["num_slabs"], d["num_blocks"], d["block_size"], d["num_heads"], d["head_dim"], d["itemsize"]) < 1:
            raise ValueError(f"an empty pool: {d}")
        return cls(**d)

    @property
    def plane_block_bytes(self) -> int:
        """One block's keys (or values)."""
        return self.block_size * self.num_heads * self.head_dim * self.itemsize

    @property
    def slab_bytes(self) -> int:
        return 2 * self.num_blocks * self.plane_block_bytes

    def block_ranges(self, first: np.ndarray, count: np.ndarray, num_blocks: int | None = None) -> np.ndarray:
        """(runs, ranges per run, 2) [offset, length] within a slab of the runs of `count` blocks
        from `first` (a slab of `num_blocks` blocks: this pool's unless given, for a staging slab)."""
        b, nb = self.plane_block_bytes, self.num_blocks if num_blocks is None else num_blocks
        if BLOCK_LAYOUTS[self.layout].planes:
            return np.stack([np.stack([first * b, count * b], 1), np.stack([(nb + first) * b, count * b], 1)], 1)
        return np.stack([first * 2 * b, count * 2 * b], 1)[:, None]


@dataclass
class ReadPlan:
    """One part's reads: runs (source first block, destination first block, count) of blocks."""
    direct: bool
    runs: np.ndarray  # (R, 3) int64
    staging_blocks: int = 0  # staged: the staging slab's blocks (the prefill blocks the part touches)
    local_slots: torch.Tensor | None = None  # staged: (num_tokens,) each token's slot in the staging slab

    def ranges(self, src: PoolShape, dst: PoolShape, src_bases: np.ndarray,
               dst_bases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) NIXL descriptors (N, 3) [address, length, device id] of layers whose
        slabs start at `src_bases` in the prefill's pool and `dst_bases` in the decode's pool
        (direct) or its staging slabs (staged), one each per layer read."""
        first_src, first_dst, count = self.runs[:, 0], self.runs[:, 1], self.runs[:, 2]
        from_src = src.block_ranges(first_src, count)  # (R, P, 2)
        into = dst.block_ranges(first_dst, count) if self.direct else src.block_ranges(first_dst, count,
                                                                                         self.staging_blocks)
        remote = np.asarray(src_bases, np.int64)[:, None, None] + from_src[None, :, :, 0]  # (L, R, P)
        local = np.asarray(dst_bases, np.int64)[:, None, None] + into[None, :, :, 0]
        lengths = np.broadcast_to(from_src[None, :, :, 1], remote.shape)
        assert np.array_equal(np.broadcast_to(into[None, :, :, 1], local.shape), lengths)

        def descs(addrs: np.ndarray, device_id: int) -> np.ndarray:
            return np.stack([addrs.ravel(), lengths.ravel(), np.full(addrs.size, device_id, np.int64)], 1)
        return descs(local, dst.device_id), descs(remote, src.device_id)



def block_runs(src_blocks: np.ndarray, dst_blocks: np.ndarray) -> np.ndarray:
    """(R, 3) runs (src first, dst first, count) where both block sequences go up by one."""
    if src_blocks.size == 0:
        return np.zeros((0, 3), np.int64)
    breaks = np.flatnonzero((np.diff(src_blocks) != 1) | (np.diff(dst_blocks) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [src_blocks.size]]))
    return np.stack([src_blocks[starts], dst_blocks[starts], counts], 1).astype(np.int64)


def _blocks_in_order(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The block of every block_size tokens when `slots` start a block and fill blocks in order
    (the last one maybe partly), else None."""
    if slots.size == 0 or slots[0] % block_size:
        return None
    blocks = slots[::block_size] // block_size
    expect = blocks.repeat(block_size)[:slots.size] * block_size + np.arange(slots.size) % block_size
    return blocks if np.array_equal(slots, expect) else None


def plan_reads(src: PoolShape, src_slots: np.ndarray, dst: PoolShape, dst_slots: np.ndarray, head_start: int,
               head_end: int) -> ReadPlan:
    """The reads of a part: heads [head_start, head_end) of the tokens at `src_slots` of the prefill's
    pool, into `dst_slots` of the decode's (module docstring: direct or staged)."""
    assert src_slots.shape == dst_slots.shape and src_slots.size, (src_slots.shape, dst_slots.shape)
    full_rows = (head_start, head_end) == (src.head_offset, src.head_offset + src.num_heads) == \
        (dst.head_offset, dst.head_offset + dst.num_heads)
    if full_rows and (src.layout, src.block_size) == (dst.layout, dst.block_size):
        src_blocks = _blocks_in_order(src_slots, src.block_size)
        dst_blocks = _blocks_in_order(dst_slots, dst.block_size)
        if src_blocks is not None and dst_blocks is not None:
            return ReadPlan(True, block_runs(src_blocks, dst_blocks))
    blocks = src_slots // src.block_size
    touched, local = np.unique(blocks, return_inverse=True)  # sorted; a token's block's index among them
    runs = block_runs(touched, np.arange(touched.size))
    local_slots = torch.from_numpy(local.astype(np.int64) * src.block_size + src_slots % src.block_size)
    return ReadPlan(False, runs, touched.size, local_slots)


def runs_to_slots(runs: np.ndarray) -> np.ndarray:
    """The slots of (first slot, length) runs, in order."""
    if runs.size == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(start, start + length, dtype=np.int64) for start, length in runs])

