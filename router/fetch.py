"""Cross-instance fetch at placement (issue 51 item 3): a prompt whose prefix another instance
holds (a prefill instance in its KV pool, or its host or disk tier: it reloads those blocks first; a
decode instance in its pool: a conversation's earlier turns, their outputs included), and the chosen
prefill instance does not, has that prefix's KV shipped over instead of computed again, when the
chosen instance's own measures say a fetch beats computing.

    under the lock (plan):  the index -> the holder H and its tokens  ->  fetch or compute
    without it (call):      P.fetch(prompt, D's params, tokens) -> from token s  ->  H.ship_held(prefix, P, s)
    H's refusal (its blocks evicted since the index's last poll, H dead): P.give_up_fetch: P computes it

The index is the policy's where it keeps one (prefix_aware); under another policy the router keeps
one of its own for fetches, following its prefill and decode instances' KV events on its load
thread, as prefix_aware does. `kv_fetch` off (the spec's): no fetch, no index followed.

The yardstick is the chosen instance's (`fetch_pays`): its prefill seconds per token computed,
times the tokens, against its fetches' seconds (from admission to the KV complete: the calls, the
holder's queue and step, the wire) fitted as fixed + per token, for that many tokens. Until both are measured a fetch is tried (the fetch measures itself;
a failed or late one is computed, so a wrong guess costs time, never output). Counted either way
in the router's stats: chosen, declined by the measures, not opened by the instance, refused by
the holder.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from engine.core.request import RequestMessage
from kvtransfer.params import KVTransferParams
from engine.core.kv_events import LEVELS, STORED
from router.client import DecodeClient, InstanceDeadError, InstanceInfo, PrefillClient
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

MIN_MEASURED_TOKENS = 256  # tokens computed (fetched) before their seconds per token are a measure


@dataclass(frozen=True)
class FetchPlan:
    holder: PrefillClient | DecodeClient
    num_tokens: int  # the prompt's leading tokens whose KV the holder ships


def fetch_pays(figures: Mapping[str, float], num_tokens: int) -> bool | None:
    """Whether fetching `num_tokens` beats computing them on the instance whose load report is
    `figures`, by its own measures: its fetches' seconds fitted as fixed + per token
    (prefill_worker/fetch_cost.py) against its prefill seconds per token computed; None until both
    are measured."""
    computed, fetched = figures.get("prefill_tokens_computed", 0.0), figures.get("kv_fetched_tokens", 0.0)
    per_token = figures.get("kv_fetch_s_per_token")
    if computed < MIN_MEASURED_TOKENS or fetched < MIN_MEASURED_TOKENS or per_token is None or num_tokens <= 0:
        return None
    compute_s = figures.get("prefill_busy_s", 0.0) / computed * num_tokens
    return figures.get("kv_fetch_fixed_s", 0.0) + per_token * num_tokens < compute_s


class Fetches:
    """The router's fetch decisions and calls (it holds one; `stats` are its tables' counters)."""

    def __init__(self, policy, prefill: Mapping[str, PrefillClient], decode: Mapping[str, DecodeClient], stats,
                 enabled: bool = True):
        """`policy`: the router's (its `index` is used where it keeps one); `prefill`, `decode`: the
        router's tables of clients, read under its lock."""
        self.prefill, self.decode, self.stats, self.enabled = prefill, decode, stats, enabled
        own = getattr(policy, "index", None)
        self.follows = own is None  # this index is followed here, for fetches alone
        self.index: PrefixIndex = PrefixIndex() if own is None else own

    def observe(self, client) -> None:
        """On the router's load thread, for each healthy instance: an index of its own follows the
        instances' caches (while the router has a prefill instance to fetch for)."""
        if self.enabled and self.follows and self.prefill and client.info.role in ("prefill", "decode"):
            self.index.follow(client)

    def forget(self, instance_id: str) -> None:
        if self.follows:
            self.index.forget(instance_id)

    def source(self, prompt: list[int], candidates: list[InstanceInfo], chosen: InstanceInfo,
               cache_salt: str | None = None) -> tuple[InstanceInfo, int, int] | None:
        """(the candidate holding the most leading prompt tokens it can ship: a prefill instance's
        at any level, a decode instance's in its pool; those tokens; the ones `chosen` holds), whole
        blocks of `chosen`'s size short of the last token; None when no candidate of that block size
        holds more than `chosen`."""
        size = chosen.block_size
        if not size:
            return None
        usable = (len(prompt) - 1) // size  # an engine computes the last token whatever it holds
        same = [c for c in candidates if c.block_size == size and c is not chosen]
        lookup = self.index.longest_prefix
        own = min(lookup(prompt, [chosen], cache_salt=cache_salt)[chosen.instance_id], usable) * size
        held = {**lookup(prompt, [c for c in same if c.role == "prefill"], LEVELS, cache_salt),
                **lookup(prompt, [c for c in same if c.role == "decode"], (STORED,), cache_salt)}
        best = max(same, key=lambda c: held.get(c.instance_id, 0), default=None)
        n = 0 if best is None else min(held.get(best.instance_id, 0), usable) * size
        return (best, n, own) if n > own else None

    def plan(self, prompt: list[int], candidates: list[InstanceInfo], chosen: InstanceInfo,
             cache_salt: str | None = None) -> FetchPlan | None:
        """Under the router's lock: the holder to fetch from, or None (compute it all). A salted
        prompt's prefix is looked up, and shipped, under its salt."""
        if not self.enabled or not chosen.kv_endpoints:  # (an instance without a fetch receiver)
            return None
        found = self.source(prompt, candidates, chosen, cache_salt)
        if found is None:
            return None
        holder, held, own = found
        if fetch_pays(chosen.load.figures, held - own) is False:
            self.stats["kv_fetches_declined"] += 1
            return None
        self.stats["kv_fetches_chosen"] += 1
        client = self.prefill.get(holder.instance_id) or self.decode[holder.instance_id]
        return FetchPlan(client, held)

    def start(self, plan: FetchPlan, prefill: PrefillClient, msg: RequestMessage, params: KVTransferParams) -> str:
        """Without the lock: the prompt goes to `prefill`, fetching its prefix from the holder, or is
        submitted whole. Returns what happened, a counter's name (`count` it under the lock).
        InstanceDeadError of `prefill` propagates; the holder's is a refusal."""
        start = prefill.fetch(msg, params, plan.num_tokens, plan.holder.info.tp_size)
        if start is None:
            return "kv_fetches_not_opened"
        ship = KVTransferParams(msg.request_id, prefill.info.instance_id, prefill.info.tp_size,
                                prefill.info.kv_endpoints, decode_cached_tokens=start,
                                cache_salt=msg.sampling_params.cache_salt)
        try:
            why = plan.holder.ship_held(msg.request_id, msg.prompt_token_ids[:plan.num_tokens], ship)
        except InstanceDeadError as exc:
            why = str(exc)
        if why is not None:
            logger.info("fetch of %s from %s refused (%s): computed on %s", msg.request_id,
                        plan.holder.info.instance_id, why, prefill.info.instance_id)
            prefill.give_up_fetch(msg.request_id)
            return "kv_fetches_refused"
        return "kv_fetches_opened"
