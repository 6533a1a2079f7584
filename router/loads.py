"""The router's view of its instances' loads: read from each instance, paced, and counted forward
between reads.

A sweep reads every healthy instance's `load()` (and lets the policy and the fetch index follow its
cache: router/prefix_index.py). Sweeps are at least `MIN_INTERVAL_S` apart, and further apart over
many instances: the calls stay under `CALLS_PER_S` (a gateway over 1,000 instances reads each about
every four seconds instead of ten times a second; at 25 and fewer nothing changes: BENCHMARKS.md
"Control plane"). Between reads a placement counts its request into the view it was placed by
(`count_placement`), so a burst does not all land on the instance that looked least loaded at the
last read.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from router.client import InstanceDeadError, InstanceInfo, InstanceLoad

logger = logging.getLogger(__name__)
MIN_INTERVAL_S = 0.1
CALLS_PER_S = 500.0  # a router's load (and cache event) calls, at most, over many instances


def refresh_loads(router) -> None:
    """The router's load thread, until it stops."""
    wait = MIN_INTERVAL_S
    while not router._stop.wait(wait):
        start, calls = time.monotonic(), 0
        for client in list(router.prefill.values()) + list(router.decode.values()):
            if not client.info.healthy:
                continue
            calls += 2  # (its load, and its cache's events where an index follows them)
            try:
                client.info.load = InstanceLoad.of(client.load())
                router.policy.observe(client)  # a prefix-aware policy follows its cache
                router.fetches.observe(client)  # (the fetches' own index, under another policy)
            except InstanceDeadError as exc:
                router.failures.mark_dead(client.info.instance_id, exc)
            except Exception:  # the thread must go on (the policy reads these loads)
                logger.exception("reading the load of %s failed", client.info.instance_id)
                with router._locked():
                    router.handler_errors["load"] += 1
        wait = next_wait(calls, time.monotonic() - start)


def next_wait(calls: int, took_s: float) -> float:
    """Seconds until the next sweep, after one of `calls` calls that took `took_s`."""
    return max(MIN_INTERVAL_S, calls / CALLS_PER_S - took_s)


def count_placement(prefill: InstanceInfo | None, decode: InstanceInfo | None, prompt_len: int,
                    max_tokens: int) -> None:
    """A request placed: its prompt queued on `prefill`, its sequence (and its KV, where the instance
    said its capacity) on `decode`, in the router's view until the next read replaces it."""
    if prefill is not None:
        load = prefill.load
        prefill.load = replace(load, queued_prefill_tokens=load.queued_prefill_tokens + prompt_len)
    if decode is not None:
        load, capacity = decode.load, decode.load.figures.get("kv_capacity_tokens", 0.0)
        share = (prompt_len + max_tokens) / capacity if capacity > 0 else 0.0
        decode.load = replace(load, reserved=load.reserved + 1, kv_usage=min(1.0, load.kv_usage + share))
