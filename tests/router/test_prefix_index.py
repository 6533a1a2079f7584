"""A router's prefix index fed by the prefill engines' KV events (router/prefix_index.py): it holds
what each instance's cache stored until the instance evicts it, at the level it holds it (its pool,
its host or disk tier), counts blocks in each engine's block size, and a new router (a restarted
gateway) rebuilds it from the instances' snapshots."""
from __future__ import annotations

import threading
import time

import pytest

from engine.core.block_manager import KVCacheManager
from engine.core.host_tier import HostTier
from engine.core.request import Request, SamplingParams
from router.client import InstanceInfo
from router.policy import create_routing_policy
from router.client import InstanceLoad
from router.prefix_index import TIER_WEIGHTS, PrefixIndex, tier_weights
from router.router import Router
from tests.engine.core.test_block_manager import prefill
from tests.router.test_router import PARAMS, FakeDecode, FakePrefill

PROMPT = list(range(10, 30))  # 20 tokens: 5 full blocks of 4


class CachingPrefill(FakePrefill):
    """A fake prefill instance whose KV events are a real allocator's (blocks of 4 tokens)."""

    def __init__(self, iid: str, load: float = 0.0, block_size: int = 4):
        super().__init__(iid, load)
        self.info.block_size = block_size
        self.kv = KVCacheManager(num_blocks=9, block_size=4)

    def kv_events(self, since):
        self._check()
        return self.kv.block_pool.events.since(since)

    def cache(self, rid: str, tokens: list[int], cache_salt: str | None = None) -> None:
        req = Request(rid, tokens, SamplingParams(cache_salt=cache_salt))
        prefill(self.kv, req)
        self.kv.cache_blocks(req, len(tokens))
        self.kv.free(req)


def test_a_salted_prompt_is_looked_up_under_its_salt():
    """p1 cached PROMPT under salt "a": the index finds it for salt "a" alone (not unsalted, not "b"),
    and the prefix-aware policy sends "a"'s prompt there, the others by load."""
    p0, p1 = CachingPrefill("p0", load=0.0), CachingPrefill("p1", load=50.0)
    p1.cache("a", PROMPT, cache_salt="a")
    index = PrefixIndex()
    policy = create_routing_policy("prefix_aware", index=index)
    for p in (p0, p1):
        policy.observe(p)
    infos = [p0.info, p1.info]
    assert [index.longest_prefix(PROMPT, infos, cache_salt=s)["p1"] for s in ("a", None, "b")] == [5, 0, 0]
    assert [policy.pick_prefill(infos, PROMPT, s).instance_id for s in ("a", None, "b")] == ["p1", "p0", "p0"]
    assert policy.prefix_reuse(PROMPT + [1], infos, p1.info, "a") == (20, 20)


def test_the_index_holds_what_an_engine_stored_until_it_evicts_it():
    p0, p1 = CachingPrefill("p0", load=0.0), CachingPrefill("p1", load=50.0)
    p1.cache("a", PROMPT)
    index = PrefixIndex()
    policy = create_routing_policy("prefix_aware", index=index)
    for p in (p0, p1):
        policy.observe(p)
    infos = [p0.info, p1.info]
    assert index.longest_prefix(PROMPT, infos) == {"p0": 0, "p1": 5}
    assert policy.pick_prefill(infos, PROMPT).instance_id == "p1"  # the prefix outweighs the load
    assert index.longest_prefix(PROMPT[:10] + [7] * 10, infos) == {"p0": 0, "p1": 2}  # leading blocks only
    p1.cache("b", list(range(100, 132)))  # 8 blocks: evicts every block of PROMPT's
    policy.observe(p1)
    assert index.longest_prefix(PROMPT, infos) == {"p0": 0, "p1": 0}
    assert policy.pick_prefill(infos, PROMPT).instance_id == "p0"  # by load again
    assert index.num_snapshots == 2 and index.num_events > 0


def test_a_new_router_rebuilds_the_index_from_the_instances():
    p1 = CachingPrefill("p1")
    p1.cache("a", PROMPT)
    old, new = PrefixIndex(), PrefixIndex()
    old.follow(p1)
    p1.cache("c", PROMPT[:8] + [5] * 12)  # 2 blocks shared, 3 more stored (room: none evicted)
    old.follow(p1)
    new.follow(p1)  # a restarted gateway: one snapshot
    assert new.longest_prefix(PROMPT, [p1.info]) == old.longest_prefix(PROMPT, [p1.info]) == {"p1": 5}
    assert new.num_snapshots == 1 and old.num_snapshots == 1 and old.num_events == 3


def test_blocks_are_counted_in_each_engines_block_size():
    p = CachingPrefill("p", block_size=4)
    p.cache("a", PROMPT)
    index = PrefixIndex()
    index.follow(p)
    assert index.longest_prefix(PROMPT, [p.info]) == {"p": 5}
    other = InstanceInfo("p", "prefill", 1, block_size=8)  # hashed in blocks of 8, the engine's are 4
    assert index.longest_prefix(PROMPT, [other]) == {"p": 0}
    assert index.longest_prefix(PROMPT, [InstanceInfo("q", "prefill", 1, block_size=4)]) == {"q": 0}


def test_blocks_in_a_tier_are_held_at_their_level_and_weigh_less_than_the_pools():
    """p0 holds the prompt's 5 blocks in its host tier (its pool evicted them), p1 the first 4 in its
    pool: both hold blocks (the router's available counter counts them all), and which one prefills
    follows the host tier's weight; a new router's snapshot gives the same levels, and one from an
    instance of an older version (no levels in its snapshot) takes every block as in the pool."""
    assert TIER_WEIGHTS["+"] == 1.0 > TIER_WEIGHTS["h"] > TIER_WEIGHTS["d"] > 0
    p0, p1 = CachingPrefill("p0", load=50.0), CachingPrefill("p1", load=0.0)
    p0.kv.tier = HostTier(8, p0.kv.block_pool)
    p0.cache("a", PROMPT)
    p0.cache("b", list(range(100, 132)))  # evicts PROMPT's blocks into the tier
    p1.cache("a", PROMPT[:16])
    infos = [p0.info, p1.info]
    for host, pick in ((0.9, "p0"), (0.7, "p1")):  # 5 x 0.9 > 4 > 5 x 0.7
        index = PrefixIndex({"+": 1.0, "h": host, "d": 0.5})
        policy = create_routing_policy("prefix_aware", index=index)
        for p in (p0, p1):
            policy.observe(p)
        assert index.hits(PROMPT, infos) == {"p0": (5, 5 * host), "p1": (4, 4.0)}
        assert index.longest_prefix(PROMPT, infos) == {"p0": 5, "p1": 4}
        assert policy.pick_prefill(infos, PROMPT).instance_id == pick
        assert policy.prefix_reuse(PROMPT + [1], infos, p1.info) == (20, 16)  # (the last token: computed)
    new = PrefixIndex()
    new.follow(p0)  # a restarted gateway: the snapshot carries the levels
    assert new.hits(PROMPT, [p0.info]) == {"p0": (5, 5 * TIER_WEIGHTS["h"])}
    old_style = {k: v for k, v in p0.kv.block_pool.events.since(-1).items() if k != "tiers"}
    p0.kv_events = lambda since: old_style
    older = PrefixIndex()
    older.follow(p0)
    assert older.hits(PROMPT, [p0.info]) == {"p0": (5, 5.0)}


def test_an_instance_that_measured_its_copies_weighs_its_tiers_by_them():
    """1 ms a prompt token (4 ms a block of 4), 0.4 ms a host reload, 2 ms a disk read: a host block
    is worth 0.9 of a pool block, a disk block 0.4; too few measured, the defaults. p0 holds the
    prompt's 5 blocks in its host tier, p1 4 in its pool: with the defaults (5 x 0.8 = 4) the tie
    goes by load, to p1; with p0's measured weights (4.5), to p0."""
    figures = {"prefill_tokens_computed": 1024, "prefill_busy_s": 1.024, "kv_host_tier_reloaded_blocks": 100,
               "kv_host_tier_reload_seconds": 0.04, "kv_disk_tier_loaded_blocks": 50, "kv_disk_tier_read_seconds": 0.1}
    assert tier_weights(figures, 4) == pytest.approx({"+": 1.0, "h": 0.9, "d": 0.4})
    assert tier_weights({**figures, "kv_host_tier_reloaded_blocks": 15}, 4) == TIER_WEIGHTS  # too few to say
    assert tier_weights({**figures, "prefill_tokens_computed": 100}, 4) == TIER_WEIGHTS
    assert tier_weights({**figures, "kv_disk_tier_loaded_blocks": 0}, 4)["d"] == TIER_WEIGHTS["d"]
    assert tier_weights({**figures, "kv_host_tier_reload_seconds": 10.0}, 4)["h"] == 0.0  # slower than computing
    p0, p1 = CachingPrefill("p0"), CachingPrefill("p1")
    p0.kv.tier = HostTier(8, p0.kv.block_pool)
    p0.cache("a", PROMPT)
    p0.cache("b", list(range(100, 132)))  # evicts PROMPT's blocks into the tier
    p1.cache("a", PROMPT[:16])
    policy = create_routing_policy("prefix_aware")
    for p in (p0, p1):
        policy.observe(p)
    p0.info.load = InstanceLoad.of({"queued_prefill_tokens": 50})
    assert policy.pick_prefill([p0.info, p1.info], PROMPT).instance_id == "p1"
    p0.info.load = InstanceLoad.of({"queued_prefill_tokens": 50, **figures})
    policy.observe(p0)  # (the policy re-reads the index after each poll)
    assert policy.pick_prefill([p0.info, p1.info], PROMPT).instance_id == "p0"


def _wait_followed(r: Router) -> None:
    """Until the router's load thread has read both prefill instances' snapshots (every 0.1 s)."""
    deadline = time.monotonic() + 10
    while r.policy.index.num_snapshots < 2:
        assert time.monotonic() < deadline, "the router did not follow its prefill instances"
        threading.Event().wait(0.02)


def test_the_router_follows_its_prefill_instances_and_routes_by_what_they_hold():
    p0, p1 = CachingPrefill("p0", load=0.0), CachingPrefill("p1", load=50.0)
    p1.cache("a", PROMPT)
    r = Router([p0, p1], [FakeDecode("d0")], create_routing_policy("prefix_aware"))
    r.start()
    try:
        _wait_followed(r)
        r.submit("x", PROMPT, PARAMS)
        deadline = time.monotonic() + 10
        while not (p0.submitted or p1.submitted):
            assert time.monotonic() < deadline
            threading.Event().wait(0.01)
        assert p1.submitted and not p0.submitted
        r.remove_instance("p1")
        assert r.policy.index.longest_prefix(PROMPT, [p1.info]) == {"p1": 0}
    finally:
        r.close()


class CachingDecode(FakeDecode):
    """A fake decode instance whose KV events are a real allocator's (blocks of 4 tokens)."""

    def __init__(self, iid: str, kv_usage: float = 0.0):
        super().__init__(iid, load={"kv_usage": kv_usage})
        self.info.block_size = 4
        self.kv = KVCacheManager(num_blocks=9, block_size=4)

    def kv_events(self, since):
        self._check()
        return self.kv.block_pool.events.since(since)

    cache = CachingPrefill.cache


def test_decode_goes_where_the_conversation_is_cached_unless_that_instance_is_much_fuller():
    """The share of the prompt held minus the share of KV in use: 5 of 5 blocks held outweighs 40
    points more KV in use, 1 held block of 5 (a shared system prompt) does not."""
    d0, d1 = CachingDecode("d0", kv_usage=0.1), CachingDecode("d1", kv_usage=0.5)
    d1.cache("a", PROMPT)
    policy = create_routing_policy("prefix_aware")
    for d in (d0, d1):
        policy.observe(d)
    infos = [d0.info, d1.info]
    assert policy.pick_decode(infos, PROMPT + [1, 2, 3]).instance_id == "d1"  # 20 of 23 tokens held
    assert policy.pick_decode(infos, PROMPT[:4] + [9] * 19).instance_id == "d0"  # 4 of 23 held
    assert create_routing_policy("least_loaded").pick_decode(infos, PROMPT).instance_id == "d0"


def test_available_routed_and_delivered_split_what_routing_left_on_the_table():
    """p0 holds a first prompt whole and 2 blocks of a second; p1 holds the second whole. A session's
    first request goes to p0 (it holds the most): available = routed. Its next request, the second
    prompt, stays on p0 by the session: 20 tokens available, 8 routed."""
    y = list(range(50, 70))
    p0, p1 = CachingPrefill("p0"), CachingPrefill("p1")
    p0.cache("y", y)
    p0.cache("p", PROMPT[:8])
    p1.cache("a", PROMPT)
    r = Router([p0, p1], [FakeDecode("d0")], create_routing_policy("prefix_aware"))
    r.start()
    try:
        _wait_followed(r)
        r.submit("first", y + [1, 2, 3], PARAMS, session="s")
        assert [m.request_id for m, _ in p0.submitted] == ["first#0"]
        assert (r.stats["prefix_available_tokens"], r.stats["prefix_routed_tokens"]) == (20, 20)
        r.submit("next", PROMPT + [1, 2, 3], PARAMS, session="s")
        assert [m.request_id for m, _ in p0.submitted] == ["first#0", "next#0"]
        assert (r.stats["prefix_available_tokens"], r.stats["prefix_routed_tokens"]) == (40, 28)
        r.submit("alone", PROMPT, PARAMS)  # no session: p1; its last block is computed whatever is held
        assert [m.request_id for m, _ in p1.submitted] == ["alone#0"]
        assert (r.stats["prefix_available_tokens"], r.stats["prefix_routed_tokens"]) == (56, 44)
    finally:
        r.close()
