"""The router's part of a request's trace (engine/core/tracing.py): its wait in the queue, and one span per
attempt, from its placement to its end (delivered, failed, retried, aborted), with the pair chosen and
why (the policy, the prefix the candidates hold, their load, a session's pull, a fetch planned). The
attempt's span is the parent the instances' spans hang under: its traceparent travels in the
RequestMessage. Its events: the prefill's first token, the decode's first output."""
from __future__ import annotations

import time

from engine.core import tracing
from router.client import InstanceInfo
from router.tables import Tracked


def open_attempt(tracked: Tracked, policy: str, prefill: InstanceInfo | None, first: InstanceInfo, local: bool,
                 reuse: tuple[int, int] | None, sticky: bool, fetch: bool) -> None:
    """Under the lock: the request's queue time (its first attempt's) and, when it is traced, the
    router's spans: `router.queue`, and the attempt's, opened in `tracked.span`. `first`: the
    decode instance the policy picked first; `reuse`: (prefix tokens available, routed to)."""
    now = time.time_ns()
    if not tracked.attempt:
        tracked.timings["queue"] = (now - tracked.submitted_ns) / 1e9
    if not tracked.trace or tracked.grouped:  # (a choice placed with its parent: the parent's span)
        return
    if not tracked.attempt:
        tracing.record("gateway", "router.queue", tracked.trace, tracked.submitted_ns, now)
    tracked.span = tracing.start("gateway", "router.attempt", tracked.trace, now, {
        "pdserve.request_id": tracked.request_id, "pdserve.attempt": tracked.attempt, "pdserve.policy": policy,
        "pdserve.prefilled_on_decode": local,
        "pdserve.prompt_tokens": len(tracked.prompt_token_ids) + len(tracked.delivered),
        "pdserve.prefill_instance": None if prefill is None else prefill.instance_id,
        "pdserve.prefill_queued_tokens": None if prefill is None else prefill.load.queued_prefill_tokens,
        "pdserve.decode_first_choice": first.instance_id, "pdserve.decode_running": first.load.running,
        "pdserve.decode_kv_usage": first.load.kv_usage, "pdserve.session_sticky": sticky, "pdserve.kv_fetch": fetch,
        "pdserve.prefix_available_tokens": None if reuse is None else reuse[0],
        "pdserve.prefix_routed_tokens": None if reuse is None else reuse[1]})


def first_token(tracked: Tracked, timings: dict[str, float] | None, cached_tokens: int) -> None:
    """The prefill's first token came: its phases' seconds, and the attempt's event."""
    tracked.timings.update(timings or {})
    tracing.event(tracked.span, "first_token", {"pdserve.instance": tracked.prefill_id,
                                                "pdserve.cached_tokens": cached_tokens})


def decoding(tracked: Tracked) -> None:
    """The decode instance's outputs have begun (its KV is there): the attempt's event, once."""
    if not tracked.decoding:
        tracing.event(tracked.span, "decoding", {"pdserve.instance": tracked.decode_id})
        tracked.decoding = True


def placed(tracked: Tracked) -> None:
    """The attempt's decode instance took it: named on its span."""
    if tracked.span is not None and tracked.decode_id is not None:
        tracked.span.set_attribute("pdserve.decode_instance", tracked.decode_id)
