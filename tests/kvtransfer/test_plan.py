"""Head slicing for heterogeneous TP: every decode rank gets exactly its heads, each once."""
from __future__ import annotations

import pytest

from kvtransfer.params import (CompatRecord, KVEndpoint, KVTransferParams, expected_parts, kv_heads_of_rank,
                               plan_head_slices)

CASES = [(4, 1, 1), (4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 4, 2), (4, 1, 4), (2, 1, 4), (2, 4, 1), (2, 4, 4),
         (3, 3, 1), (3, 1, 3), (2, 2, 4), (8, 2, 4), (8, 4, 2)]


@pytest.mark.parametrize("heads,ptp,dtp", CASES)
def test_each_decode_rank_gets_its_heads_once(heads, ptp, dtp):
    """The parts to decode rank d cover kv_heads_of_rank(d) exactly, each from a prefill rank
    that holds those heads; decode rank 0 always hears from prefill rank 0 (the first token)."""
    slices = plan_head_slices(heads, ptp, dtp)
    for d in range(dtp):
        got = sorted(h for s in slices if s.decode_rank == d for h in range(s.head_start, s.head_end))
        assert got == list(kv_heads_of_rank(heads, dtp, d))
        assert expected_parts(heads, ptp, dtp, d) == sum(s.decode_rank == d for s in slices)
    for s in slices:
        held = kv_heads_of_rank(heads, ptp, s.prefill_rank)
        assert s.head_start in held and s.head_end - 1 in held
    assert any(s.prefill_rank == 0 and s.decode_rank == 0 for s in slices)


def test_replicated_heads_sent_once():
    """With prefill tp 4 over 2 heads (each head on two ranks), only ranks 0 and 2 send."""
    assert {s.prefill_rank for s in plan_head_slices(2, 4, 1)} == {0, 2}


def test_kv_heads_of_rank_rejects_bad_splits():
    with pytest.raises(ValueError):
        kv_heads_of_rank(3, 2, 0)
    with pytest.raises(ValueError):
        kv_heads_of_rank(4, 2, 2)
    assert kv_heads_of_rank(2, 4, 3) == range(1, 2) and kv_heads_of_rank(4, 2, 1) == range(2, 4)


def test_compat_mismatch_names_fields():
    """A mismatch message names every disagreeing field; informational fields may differ."""
    a = CompatRecord("m", "float32", 2, 4, 8, block_size=16, tp_size=1)
    assert a.mismatch(CompatRecord("m", "float32", 2, 4, 8, block_size=32, tp_size=2)) is None
    msg = a.mismatch(CompatRecord("m", "bfloat16", 3, 4, 8))
    assert "dtype" in msg and "num_layers" in msg and "head_dim" not in msg
    assert CompatRecord.from_dict(a.to_dict()) == a
    for bad in (None, [], {"model": "m"}, {**a.to_dict(), "extra": 1}, {**a.to_dict(), "num_layers": 0}):
        with pytest.raises(ValueError):
            CompatRecord.from_dict(bad)


def test_transfer_params_check_endpoints():
    eps = (KVEndpoint("d", 0, "h", 1), KVEndpoint("d", 1, "h", 2))
    KVTransferParams("r", "d", 2, eps)
    with pytest.raises(AssertionError):
        KVTransferParams("r", "d", 1, eps)
