"""The scheduler's side of speculation: rollback of draft slots (KVCacheManager.trim), the per-batch
decision from a profile and the measured acceptance, the metrics."""
from __future__ import annotations

import logging

from engine.core.block_manager import KVCacheManager
from engine.core.request import Request, SamplingParams
from engine.core.speculative_config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.profile import EVERY_BATCH, SpecProfile
from engine.speculative.speculator import EXPLORE_EVERY, MIN_MEASURED, Speculator


def allocator_state(kv: KVCacheManager, rid: str):
    cached = {h: b.block_id for h, b in kv.block_pool._cached.items()}
    return kv.num_free_blocks, kv.get_block_ids(rid), cached, kv.get_block_hashes(rid)


def test_rollback_leaves_the_allocator_as_it_was():
    """Slots for 8 drafts crossing two block boundaries, then none kept: the free blocks, the
    table, the prefix cache and the hashes are those of a step without drafts."""
    def decoding(kv: KVCacheManager) -> Request:
        req = Request("a", list(range(10, 23)), SamplingParams(max_tokens=50))  # 13 tokens, 12 computed
        assert kv.allocate_slots(req, 13) is not None
        req.num_computed_tokens = 12
        return req

    plain = KVCacheManager(32, 4)
    req = decoding(plain)
    plain.allocate_slots(req, 1)
    spec = KVCacheManager(32, 4)
    req = decoding(spec)
    new = spec.allocate_slots(req, 1 + 8)
    assert len(new[0]) == 2
    assert spec.trim(req, req.num_computed_tokens + 1) == ([b.block_id for b in new[0]],)
    assert allocator_state(spec, "a") == allocator_state(plain, "a")


def profile() -> SpecProfile:
    """Speculation pays up to batch 4 when 2 drafts are kept per step, up to 1 at 0.5."""
    return SpecProfile((1, 2, 4, 8), decode_s=(10, 11, 12, 20), verify_s=(12, 16, 20, 70), propose_s=(1, 1, 2, 2))


def decoding_requests(n: int, max_tokens: int = 50) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
        r.output_token_ids, r.num_computed_tokens = [4], 3
        reqs.append(r)
    return reqs


def test_speculation_turns_off_above_the_batch_size_where_it_stops_paying(caplog):
    assert profile().max_batch_size(2.0) == 4 and profile().max_batch_size(0.5) == 1
    assert profile().max_batch_size(0.0) == 0 and profile().max_batch_size(9.0) == EVERY_BATCH
    with caplog.at_level(logging.INFO, logger="engine.speculative.speculator"):
        s = Speculator(SpeculativeConfig("ngram", 3), NgramProposer(), profile())
        assert s.max_batch == EVERY_BATCH  # before measuring: every draft taken to be kept
        for _ in range(MIN_MEASURED):
            s.record(3, 2)
    assert s.max_batch == 4
    assert "on up to 4 decoding sequences, off above (2.00 drafts accepted per step)" in caplog.text
    assert s.plan(decoding_requests(4), set(), 1000) == {f"r{i}": 3 for i in range(4)}
    assert s.plan(decoding_requests(4), {"r1"}, 1000).keys() == {"r0", "r2", "r3"}
    assert s.plan(decoding_requests(2, max_tokens=3), set(), 1000) == {"r0": 1, "r1": 1}  # room for 2 more tokens
    assert s.plan(decoding_requests(1), set(), 6) == {"r0": 1}  # the context holds 6 tokens
    over = [s.plan(decoding_requests(5), set(), 1000) for _ in range(EXPLORE_EVERY)]
    assert sum(bool(p) for p in over) == 1  # still measuring, once in EXPLORE_EVERY steps
    for _ in range(10 * MIN_MEASURED):
        s.record(3, 0)
    assert s.max_batch == 0


def test_metrics_per_method_and_position():
    s = Speculator(SpeculativeConfig("ngram", 2, max_batch_size=8), NgramProposer(), None)
    s.record(2, 1)
    s.record(1, 1)
    s.record(2, 0)
    figures = s.figures()
    assert figures["spec_proposed/ngram/0"] == 3 and figures["spec_accepted/ngram/0"] == 2
    assert figures["spec_proposed/ngram/1"] == 2 and figures["spec_accepted/ngram/1"] == 0
    assert figures["spec_acceptance/ngram/0"] == 2 / 3 and figures["spec_max_batch"] == 8
