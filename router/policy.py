"""Routing policies: which prefill and which decode instance serve a request.

Each is a `BaseRoutingPolicy`; `ROUTING_POLICIES` is the registry (its names are the spec's
`router_policy` choices, checked at import), `create_routing_policy(name)` its factory.
"""
from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable

from cluster.spec import spec_registry
from router.client import DecodeClient, InstanceInfo, PrefillClient
from router.prefix_index import PrefixIndex


class BaseRoutingPolicy(ABC):
    name = "base"

    @abstractmethod
    def pick_prefill(self, candidates: list[InstanceInfo], prompt_token_ids: list[int],
                     cache_salt: str | None = None) -> InstanceInfo:
        """One of `candidates` (non-empty, healthy) to prefill the prompt (`cache_salt`: its salt, which
        its blocks' hashes start from: SamplingParams.cache_salt)."""

    @abstractmethod
    def pick_decode(self, candidates: list[InstanceInfo], prompt_token_ids: list[int],
                    cache_salt: str | None = None) -> InstanceInfo:
        """One of `candidates` (non-empty, healthy) to decode the request."""

    def observe(self, client: PrefillClient | DecodeClient) -> None:
        """Called for each healthy instance on the router's load thread (every 0.1 s)."""

    def forget(self, instance_id: str) -> None:
        """The instance left the router."""

    def prefix_reuse(self, prompt_token_ids: list[int], candidates: list[InstanceInfo],
                     chosen: InstanceInfo, cache_salt: str | None = None) -> tuple[int, int] | None:
        """(available, routed): the most prompt tokens any candidate's prefix cache holds that its
        engine could reuse, and those `chosen` holds; None: the policy keeps no index."""
        return None


class RoundRobin(BaseRoutingPolicy):
    name = "round_robin"

    def __init__(self):
        self._p, self._d = itertools.count(), itertools.count()

    def pick_prefill(self, candidates, prompt_token_ids, cache_salt=None):
        return candidates[next(self._p) % len(candidates)]

    def pick_decode(self, candidates, prompt_token_ids, cache_salt=None):
        return candidates[next(self._d) % len(candidates)]


class LeastLoaded(BaseRoutingPolicy):
    """Prefill: fewest queued prompt tokens. Decode: lowest KV use, then fewest running."""

    name = "least_loaded"

    def pick_prefill(self, candidates, prompt_token_ids, cache_salt=None):
        return min(candidates, key=lambda c: (c.load.queued_prefill_tokens, c.instance_id))

    def pick_decode(self, candidates, prompt_token_ids, cache_salt=None):
        return min(candidates, key=lambda c: (round(c.load.kv_usage, 2),
                                              c.load.running + c.load.reserved,
                                              c.instance_id))


class PrefixAware(LeastLoaded):
    """Prefill where the longest prefix of the prompt is cached, ties broken by load. Decode (and
    colocated) where the share of the prompt its cache holds (a delta transfer ships only the rest,
    a colocated instance computes only the rest) minus the share of its KV in use is highest, so a
    prefix every session shares (a system prompt) does not herd them all onto one instance. What
    each instance caches is what its engine says it stored and evicted (router/prefix_index.py,
    followed on the router's load thread: llm-d's precise index), never a guess at routing time;
    a block in a tier under its pool counts for less than one in the pool (the index's weights)."""

    name = "prefix_aware"

    def __init__(self, index: PrefixIndex | None = None):
        self.index = index or PrefixIndex()
        self._last: tuple = ()  # (prompt, candidates' ids, hits): a placement asks for the same one twice

    def _hits(self, prompt_token_ids, candidates, cache_salt) -> dict[str, tuple[int, float]]:
        """The index's hits per candidate, (blocks, weighted blocks), hashed once per prompt, salt and
        candidate set: a placement's pick and its `prefix_reuse` ask for the same (the router holds
        its lock across both)."""
        ids = [c.instance_id for c in candidates]
        if self._last and self._last[0] is prompt_token_ids and self._last[1:3] == (ids, cache_salt):
            return self._last[3]
        hits = self.index.hits(prompt_token_ids, candidates, cache_salt=cache_salt)
        self._last = (prompt_token_ids, ids, cache_salt, hits)
        return hits

    def observe(self, client):
        self.index.follow(client)
        self._last = ()  # the index may have changed

    def forget(self, instance_id):
        self.index.forget(instance_id)
        self._last = ()

    def prefix_reuse(self, prompt_token_ids, candidates, chosen, cache_salt=None):
        hits = self._hits(prompt_token_ids, candidates, cache_salt)
        last = len(prompt_token_ids) - 1  # an engine computes a prompt's last token whatever it holds
        held = {c.instance_id: min(hits[c.instance_id][0], last // c.block_size) * c.block_size if c.block_size else 0
                for c in candidates}
        return max(held.values(), default=0), held.get(chosen.instance_id, 0)

    def pick_prefill(self, candidates, prompt_token_ids, cache_salt=None):
        hits = self._hits(prompt_token_ids, candidates, cache_salt)
        return min(candidates, key=lambda c: (-hits[c.instance_id][1], c.load.queued_prefill_tokens,
                                              c.instance_id))

    def pick_decode(self, candidates, prompt_token_ids, cache_salt=None):
        hits = self._hits(prompt_token_ids, candidates, cache_salt)
        n = max(1, len(prompt_token_ids))
        return min(candidates, key=lambda c: (round(c.load.kv_usage - hits[c.instance_id][1] * c.block_size / n, 2),
                                              c.load.running + c.load.reserved, c.instance_id))


class SessionAffinity:
    """Which instances served a session's last request (its `x-session-id` header, or the request's
    `user` field: the spec's `session_affinity`): its next request prefers them, whatever the policy,
    while they are healthy (a decode instance without room passes the request on as any first pick
    does). A conversation's next turn then finds its earlier turns' KV where it left it, in the
    prefill instance's prefix cache and the decode instance's (a delta transfer ships only the new
    turn). Kept per router (per gateway), least recently used first out past `max_sessions`, and
    forgotten `ttl_s` after a session's last request."""

    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 1800.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self._last: OrderedDict[str, tuple[float, str | None, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def served(self, session: str) -> tuple[str | None, str] | None:
        """(prefill instance id or None, decode instance id) of the session's last request; None:
        unknown, or idle past the TTL."""
        entry = self._last.get(session)
        if entry is None:
            return None
        if self.clock() - entry[0] > self.ttl_s:
            del self._last[session]
            return None
        return entry[1], entry[2]

    def last(self, session: str | None, prefills: list[InstanceInfo], decodes: list[InstanceInfo]) -> tuple:
        """Of the candidates, the prefill and the decode instance (InstanceInfo, or None) the
        session's last request ran on."""
        served = self.served(session) if session else None
        if served is None:
            return None, None
        return (next((i for i in prefills if i.instance_id == served[0]), None),
                next((i for i in decodes if i.instance_id == served[1]), None))

    def placed(self, session: str, prefill_id: str | None, decode_id: str) -> bool:
        """Records where the session's request runs; whether that is where its last one ran."""
        same = self.served(session) == (prefill_id, decode_id)
        self._last[session] = (self.clock(), prefill_id, decode_id)
        self._last.move_to_end(session)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        return same


ROUTING_POLICIES = spec_registry("router_policy", {p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware)})


def create_routing_policy(name: str, **kwargs) -> BaseRoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](**kwargs)
