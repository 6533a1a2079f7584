"""Routing policies: which prefill and which decode instance serve a request.

Each is a `BaseRoutingPolicy`; `ROUTING_POLICIES` is the registry (its names are the spec's
`router_policy` choices, checked at import), `create_routing_policy(name)` its factory.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from cluster.spec import spec_registry
from router.client import DecodeClient, InstanceInfo, PrefillClient
from router.prefix_index import PrefixIndex


class BaseRoutingPolicy(ABC):
    name = "base"

    @abstractmethod
    def pick_prefill(self, candidates: list[InstanceInfo], prompt_token_ids: list[int]) -> InstanceInfo:
        """One of `candidates` (non-empty, healthy) to prefill the prompt."""

    @abstractmethod
    def pick_decode(self, candidates: list[InstanceInfo], prompt_token_ids: list[int]) -> InstanceInfo:
        """One of `candidates` (non-empty, healthy) to decode the request."""

    def observe(self, client: PrefillClient | DecodeClient) -> None:
        """Called for each healthy instance on the router's load thread (every 0.1 s)."""

    def forget(self, instance_id: str) -> None:
        """The instance left the router."""


class RoundRobin(BaseRoutingPolicy):
    name = "round_robin"

    def __init__(self):
        self._p, self._d = itertools.count(), itertools.count()

    def pick_prefill(self, candidates, prompt_token_ids):
        return candidates[next(self._p) % len(candidates)]

    def pick_decode(self, candidates, prompt_token_ids):
        return candidates[next(self._d) % len(candidates)]


class LeastLoaded(BaseRoutingPolicy):
    """Prefill: fewest queued prompt tokens. Decode: lowest KV use, then fewest running."""

    name = "least_loaded"

    def pick_prefill(self, candidates, prompt_token_ids):
        return min(candidates, key=lambda c: (c.load.queued_prefill_tokens, c.instance_id))

    def pick_decode(self, candidates, prompt_token_ids):
        return min(candidates, key=lambda c: (round(c.load.kv_usage, 2),
                                              c.load.running + c.load.reserved,
                                              c.instance_id))


class PrefixAware(LeastLoaded):
    """Prefill where the longest prefix of the prompt is cached, ties broken by load. Decode (and
    colocated) where the share of the prompt its cache holds (a delta transfer ships only the rest,
    a colocated instance computes only the rest) minus the share of its KV in use is highest, so a
    prefix every session shares (a system prompt) does not herd them all onto one instance. What
    each instance caches is what its engine says it stored and evicted (router/prefix_index.py,
    followed on the router's load thread: llm-d's precise index), never a guess at routing time."""

    name = "prefix_aware"

    def __init__(self, index: PrefixIndex | None = None):
        self.index = index or PrefixIndex()

    def observe(self, client):
        self.index.follow(client)

    def forget(self, instance_id):
        self.index.forget(instance_id)

    def pick_prefill(self, candidates, prompt_token_ids):
        hits = self.index.longest_prefix(prompt_token_ids, candidates)
        return min(candidates, key=lambda c: (-hits.get(c.instance_id, 0), c.load.queued_prefill_tokens,
                                              c.instance_id))

    def pick_decode(self, candidates, prompt_token_ids):
        hits = self.index.longest_prefix(prompt_token_ids, candidates)
        n = max(1, len(prompt_token_ids))
        return min(candidates, key=lambda c: (round(c.load.kv_usage - hits[c.instance_id] * c.block_size / n, 2),
                                              c.load.running + c.load.reserved, c.instance_id))


ROUTING_POLICIES = spec_registry("router_policy", {p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware)})


def create_routing_policy(name: str, **kwargs) -> BaseRoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](**kwargs)
