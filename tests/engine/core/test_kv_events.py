"""The prefix cache's event log (engine/core/kv_events.py): a reader follows what a KV allocator
stored and evicted by sequence number; a new reader, one that fell behind the log, or one holding a
cursor of another life starts from a snapshot of what is held."""
from __future__ import annotations

from engine.core.block_manager import KVCacheManager, block_hashes
from engine.core.kv_events import KVEventLog
from engine.core.request import Request
from tests.engine.core.test_block_manager import prefill


def test_a_reader_follows_what_the_cache_stores_and_evicts():
    mgr = KVCacheManager(num_blocks=9, block_size=4)  # 8 blocks besides the null one
    log = mgr.block_pool.events
    start = log.since(-1)
    assert start["snapshot"] == [] and start["seq"] == 0
    a = Request("a", list(range(10, 26)))  # 16 tokens: 4 full blocks
    prefill(mgr, a)
    mgr.cache_blocks(a, 16)
    stored = log.since(start["seq"])
    assert stored["events"] == [("+", h) for h in block_hashes(a.prompt_token_ids, 4)]
    mgr.free(a)  # free, still cached: nothing evicted yet
    assert log.since(stored["seq"])["events"] == []
    b = Request("b", list(range(100, 132)))  # 8 blocks: every block a's were
    prefill(mgr, b)
    mgr.cache_blocks(b, 32)
    events = log.since(stored["seq"])["events"]
    assert sorted(h for op, h in events if op == "-") == sorted(block_hashes(a.prompt_token_ids, 4))
    assert [h for op, h in events if op == "+"] == block_hashes(b.prompt_token_ids, 4)
    assert sorted(log.since(-1)["snapshot"]) == sorted(block_hashes(b.prompt_token_ids, 4))  # a new reader
    mgr.free(b)
    assert mgr.block_pool.reset_prefix_cache()
    assert log.since(log.seq - 1)["events"] == [("0", 0)] and log.since(-1)["snapshot"] == []


def test_a_reader_behind_the_log_or_from_another_life_gets_a_snapshot():
    log = KVEventLog(capacity=4)
    for h in range(1, 7):
        log.stored(h)
    log.removed(2)
    log.stored(("group 1", 9))  # another KV group's key: not a router's to match
    assert log.seq == 7
    assert log.since(3)["events"] == [("+", 4), ("+", 5), ("+", 6), ("-", 2)]
    assert sorted(log.since(2)["snapshot"]) == [1, 3, 4, 5, 6]  # 5 events back: the log holds 4
    assert "snapshot" in log.since(8)  # a cursor ahead of the log: another life's
    assert log.since(7)["epoch"] != KVEventLog(4).since(0)["epoch"]


def test_a_block_moves_between_levels_and_news_is_logged_once():
    """`moved` to the host or disk tier, `stored` back in the pool: each change one event, a level
    said again none, a removal of what is not held none; the snapshot lists every held block and,
    apart, those held in a tier alone."""
    log = KVEventLog(16)
    log.stored(1), log.stored(2), log.stored(3)
    cursor = log.seq
    log.moved(1, "h"), log.moved(1, "h"), log.moved(2, "d"), log.stored(1)
    log.removed(3), log.removed(3), log.removed(99)
    assert log.since(cursor)["events"] == [("h", 1), ("d", 2), ("+", 1), ("-", 3)]
    assert (log.level(1), log.level(2), log.level(3)) == ("+", "d", None)
    snapshot = log.since(-1)
    assert sorted(snapshot["snapshot"]) == [1, 2] and snapshot["tiers"] == {"h": [], "d": [2]}
