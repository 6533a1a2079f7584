"""The router's cross-instance fetch (router/fetch.py) against fake prefill instances: a prompt
routed away from the instance holding its prefix is fetched from it (the fetcher told first, the
holder then told where to ship from), unless the fetcher's measures say computing is faster; a
holder's refusal makes the fetcher compute it, and fails nothing."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from kvtransfer.params import KVEndpoint
from prefill_worker.fetch_cost import FetchCost
from router.client import InstanceLoad
from router.fetch import MIN_MEASURED_TOKENS, fetch_pays
from router.policy import LeastLoaded, PrefixAware
from router.router import Router
from engine.core.kv_events import HOST
from tests.router.test_prefix_index import PROMPT, CachingDecode, CachingPrefill
from tests.router.test_router import PARAMS, FakeDecode


class FetchingPrefill(CachingPrefill):
    """A caching fake that can fetch (holding `own` tokens of every prompt) and ship what it holds."""

    def __init__(self, iid: str, own: int = 0):
        super().__init__(iid)
        self.info.kv_endpoints = (KVEndpoint(iid, 0, "127.0.0.1", 2),)
        self.own, self.fetches, self.ships, self.given_up, self.refuse = own, [], [], [], None

    def fetch(self, msg, params, num_tokens, holder_tp):
        self._check()
        self.fetches.append((msg.request_id, num_tokens, holder_tp))
        return self.own

    def ship_held(self, request_id, token_ids, params):
        self._check()
        self.ships.append((request_id, list(token_ids), params))
        return self.refuse

    def give_up_fetch(self, request_id):
        self.given_up.append(request_id)


class AwayFromThePrefix(PrefixAware):
    def pick_prefill(self, candidates, prompt_token_ids, cache_salt=None):
        hits = self._hits(prompt_token_ids, candidates, cache_salt)
        return min(candidates, key=lambda c: (hits[c.instance_id][0], c.instance_id))


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.01)


def _router(figures: dict | None = None, policy=None):
    holder, fetcher = FetchingPrefill("p0"), FetchingPrefill("p1")
    holder.cache("a", PROMPT)  # 5 blocks of 4
    fetcher.info.load = InstanceLoad.of(figures or {})
    r = Router([holder, fetcher], [FakeDecode("d0")], policy or AwayFromThePrefix())
    r.start()
    _until(lambda: r.fetches.index.num_snapshots >= 2, "the router follows both instances")
    return r, holder, fetcher


def test_fetch_pays_by_the_instances_own_measures():
    """Computing costs 1 ms a token; a fetch 20 ms plus 0.1 ms a token: it pays from 23 tokens on."""
    n = MIN_MEASURED_TOKENS
    assert fetch_pays({}, 16) is None  # unmeasured: a fetch is tried
    assert fetch_pays({"prefill_tokens_computed": n, "prefill_busy_s": n * 1e-3}, 16) is None
    measured = {"prefill_tokens_computed": n, "prefill_busy_s": n * 1e-3, "kv_fetched_tokens": n,
                "kv_fetch_fixed_s": 0.02, "kv_fetch_s_per_token": 1e-4}
    assert fetch_pays(measured, 16) is False and fetch_pays(measured, 32) is True


def test_the_fetch_cost_fit_separates_a_fixed_part_from_a_per_token_part():
    cost = FetchCost()
    assert cost.fit() is None and cost.figures() == {}
    cost.add(100, 0.02 + 100 * 1e-4)
    assert cost.fit() == (0.0, pytest.approx(3e-4))  # one size: the mean per token
    for tokens in (16, 200, 400):
        cost.add(tokens, 0.02 + tokens * 1e-4)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.02) and per_token == pytest.approx(1e-4)


class ToTheSecond(LeastLoaded):
    """No index of its own: the router's fetches keep one."""

    def pick_prefill(self, candidates, prompt_token_ids, cache_salt=None):
        return candidates[-1]


@pytest.mark.parametrize("policy", [AwayFromThePrefix, ToTheSecond], ids=["the-policys-index", "the-routers-own"])
def test_routed_away_from_the_holder_the_prefix_is_fetched_from_it(policy):
    r, holder, fetcher = _router(policy=policy())
    assert (r.fetches.index is getattr(r.policy, "index", None)) == (policy is AwayFromThePrefix)
    try:
        r.submit("x", PROMPT + [5, 6], PARAMS)
        _until(lambda: holder.ships, "the holder told to ship")
        (rid, num_tokens, holder_tp), = fetcher.fetches
        assert num_tokens == 20 and holder_tp == 1 and not fetcher.submitted  # 5 whole blocks, short of the last
        (sid, tokens, params), = holder.ships
        assert sid == rid and tokens == PROMPT and params.endpoints == fetcher.info.kv_endpoints
        assert params.decode_cached_tokens == fetcher.own and params.decode_instance_id == "p1"
        stats = r.snapshot()
        assert (stats["kv_fetches_chosen"], stats["kv_fetches_opened"]) == (1, 1)

        # the holder refuses (its blocks evicted since the index's last poll): the fetcher computes it
        holder.refuse = "cannot ship the held prefix: holds fewer than the 5 blocks"
        r.submit("y", PROMPT + [7, 8], PARAMS)
        _until(lambda: len(holder.ships) == 2 and fetcher.given_up, "the fetcher told to compute it")
        assert fetcher.given_up == [holder.ships[1][0]]
        stats = r.snapshot()
        assert stats["kv_fetches_refused"] == 1 and stats["failed"] == 0 and stats["retries"] == 0
    finally:
        r.close()


def test_a_salted_prefix_is_fetched_under_its_salt_alone():
    """The holder cached PROMPT under salt "s": a request of that salt fetches it, the holder told to
    look its blocks up under "s"; one of another salt, or none, finds nothing to fetch."""
    holder, fetcher = FetchingPrefill("p0"), FetchingPrefill("p1")
    holder.cache("a", PROMPT, cache_salt="s")
    r = Router([holder, fetcher], [FakeDecode("d0")], AwayFromThePrefix())
    r.start()
    try:
        _until(lambda: r.fetches.index.num_snapshots >= 2, "the router follows both instances")
        for rid, salt in (("none", None), ("other", "t")):
            r.submit(rid, PROMPT + [5, 6], replace(PARAMS, cache_salt=salt))
        _until(lambda: len(fetcher.submitted) + len(holder.submitted) == 2, "both placed")
        assert not holder.ships and not fetcher.fetches
        r.submit("salted", PROMPT + [5, 6], replace(PARAMS, cache_salt="s"))
        _until(lambda: holder.ships, "the holder told to ship")
        (_, tokens, params), = holder.ships
        assert tokens == PROMPT and params.cache_salt == "s"
    finally:
        r.close()


def test_a_fetch_its_measures_say_is_slower_is_declined_and_computed():
    n = MIN_MEASURED_TOKENS
    r, holder, fetcher = _router({"prefill_tokens_computed": n, "prefill_busy_s": 0.1, "kv_fetched_tokens": n,
                                  "kv_fetch_s_per_token": 1.0 / n})
    try:
        r.submit("x", PROMPT + [5, 6], PARAMS)
        _until(lambda: fetcher.submitted, "the prompt submitted whole")
        assert not fetcher.fetches and not holder.ships
        assert r.snapshot()["kv_fetches_declined"] == 1
    finally:
        r.close()


class ShippingDecode(CachingDecode):
    """A caching fake decode instance that ships what its pool holds."""

    def __init__(self, iid: str):
        super().__init__(iid)
        self.ships = []

    def ship_held(self, request_id, token_ids, params):
        self._check()
        self.ships.append((request_id, list(token_ids), params))
        return None


def test_a_decode_instance_holding_the_conversation_ships_it_from_its_pool():
    """The decode instance holds the last turn (prompt and output) in its pool: the prefill
    instance fetches it from there; blocks only in its (write-through) host tier do not count."""
    decode, fetcher = ShippingDecode("d0"), FetchingPrefill("p0")
    decode.cache("turn", PROMPT)
    r = Router([fetcher], [decode], LeastLoaded())
    r.start()
    try:
        _until(lambda: r.fetches.index.num_snapshots >= 2, "the router follows both instances")
        r.submit("x", PROMPT + [5, 6], PARAMS)
        _until(lambda: decode.ships, "the decode instance told to ship")
        (rid, num_tokens, _), = fetcher.fetches
        assert num_tokens == 20 and decode.ships[0][0] == rid and decode.ships[0][1] == PROMPT
    finally:
        r.close()
    # the same blocks in its host tier only: not a holder (it ships from its pool)
    hashes = decode.kv.block_pool.events.since(-1)["snapshot"]
    decode.kv_events = lambda since: {"epoch": "another life", "seq": 0, "snapshot": [], "tiers": {HOST: hashes}}
    r.fetches.index.follow(decode)
    assert r.fetches.index.longest_prefix(PROMPT, [decode.info]) == {"d0": 5}  # held, in the tier
    assert r.fetches.source(PROMPT + [5, 6], [decode.info], fetcher.info) is None
