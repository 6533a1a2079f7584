"""Which prefill rank sends which KV heads to which decode rank (heterogeneous TP).

Example: 4 KV heads, prefill tp=1, decode tp=2      prefill tp=2, decode tp=1
    P0 [h0 h1 h2 h3]                                   P0 [h0 h1]   P1 [h2 h3]
        |  |   \\  \\                                      \\  /         \\  /
    D0 [h0 h1]  D1 [h2 h3]                                 D0 [h0 h1 h2 h3]
Each decode rank's heads come from the lowest prefill rank holding them (a replicated head is
sent once). Decode rank 0 always gets a part from prefill rank 0, which carries the trailer (base.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.params import kv_heads_of_rank


@dataclass(frozen=True)
class HeadSlice:
    prefill_rank: int
    decode_rank: int
    head_start: int  # global KV head index, inclusive
    head_end: int    # exclusive

    def __post_init__(self):
        assert 0 <= self.head_start < self.head_end, self


def _holder(head: int, num_kv_heads: int, prefill_tp: int) -> int:
    return next(p for p in range(prefill_tp) if head in kv_heads_of_rank(num_kv_heads, prefill_tp, p))


def plan_head_slices(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadSlice]:
    """Every (prefill rank, decode rank, contiguous head range) part of one request's transfer."""
    out: list[HeadSlice] = []
    for d in range(decode_tp):
        heads = kv_heads_of_rank(num_kv_heads, decode_tp, d)
        start = heads.start
        for h in heads:
            if h + 1 == heads.stop or _holder(h + 1, num_kv_heads, prefill_tp) != _holder(h, num_kv_heads, prefill_tp):
                out.append(HeadSlice(_holder(h, num_kv_heads, prefill_tp), d, start, h + 1))
                start = h + 1
    assert any(s.prefill_rank == 0 and s.decode_rank == 0 for s in out)
    return out


def expected_parts(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """How many parts decode rank `decode_rank` receives for one request."""
    return sum(s.decode_rank == decode_rank for s in plan_head_slices(num_kv_heads, prefill_tp, decode_tp))
