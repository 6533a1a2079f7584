"""The router's tables, and the request streams they hold.

The tables (`RouterTables`) and their lock: what the router (router/router.py) and its failure policy
(router/failures.py) both read and change. Everything here is guarded by `lock`; calls to instances
wanted under it (aborts) go to `deferred` and run once the outermost holder releases it.

`RequestStream`: what a caller gets back from the router: a stream of token batches for one request."""
from __future__ import annotations

import logging
import queue
import threading
import time
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

from engine.core import tracing
from engine.core.request import SamplingParams, choice_id
from router.client import DecodeClient, InstanceDeadError, PrefillClient
from router.flow import FlowQueue

logger = logging.getLogger(__name__)

# what a guard catches an exception in (the label of pdserve_router_handler_errors_total)
HANDLERS = ("place", "prefill_result", "decode_output", "deferred", "load")
# a request's phases, in seconds, as its end event reports them (StreamEvent.timings): the router's
# queue, the prefill instance's queue and compute, the decode instance's wait for the KV and its decode
PHASES = ("queue", "prefill_queue", "prefill", "kv_transfer", "decode")
# cumulative counters (the autoscaler's arrival rate and request shape come from these)
STATS = ("retries", "failed", "completed", "submitted", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
         "instance_deaths", "kv_recomputes", "queue_timeouts", "tokens_past_stop", "session_placements",
         "prefix_available_tokens", "prefix_routed_tokens",
         # cross-instance fetch (router/fetch.py)
         "kv_fetches_chosen", "kv_fetches_declined", "kv_fetches_opened", "kv_fetches_not_opened", "kv_fetches_refused")


class RouterTables:
    """Instances, requests and counters of one router, under one lock."""

    def __init__(self, prefill: list[PrefillClient], decode: list[DecodeClient], max_queued: int = 4096,
                 queue_timeout_s: float = math.inf):
        self.prefill = {c.info.instance_id: c for c in prefill}
        self.decode = {c.info.instance_id: c for c in decode}
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)  # the placement thread: queue or capacity changed
        self.deferred: list[tuple] = []  # (fn, *args) wanted under the lock, run once it is released
        self._tls = threading.local()  # per thread: nesting of locked() (a Condition wait lets others in)
        self.live: dict[str, Tracked] = {}  # request id -> request, until it has finished
        self.by_attempt: dict[str, Tracked] = {}
        self.pending = FlowQueue(max_queued, queue_timeout_s)  # waiting for a decode instance to accept
        self.stopped: dict[str, None] = {}  # attempt ids ended by `stop` (latest 1024): their late tokens count
        self.stats = dict.fromkeys(STATS, 0)
        self.handler_errors = dict.fromkeys(HANDLERS, 0)  # exceptions guards caught (each failed one request)

    @contextmanager
    def locked(self):
        """The lock; calls deferred while it was held run after the outermost release."""
        with self.lock:
            depth = getattr(self._tls, "depth", 0)
            self._tls.depth = depth + 1
            try:
                yield
            finally:
                self._tls.depth = depth
                calls = []
                if depth == 0:
                    calls = list(self.deferred)
                    self.deferred.clear()
        for fn, *args in calls:
            self._safe(fn, *args)

    def _safe(self, fn, *args) -> None:
        """A call deferred until the lock was released (an abort): never raises."""
        try:
            fn(*args)
        except InstanceDeadError:
            pass
        except Exception:  # nothing waits on it: logged and counted, the caller's thread goes on
            logger.exception("deferred call %s%s failed", getattr(fn, "__qualname__", fn), args)
            with self.lock:
                self.handler_errors["deferred"] += 1

    def client(self, instance_id: str) -> PrefillClient | DecodeClient | None:
        return self.prefill.get(instance_id) or self.decode.get(instance_id)

    def abort_attempt(self, tracked: Tracked, outcome: str = "aborted", error: str | None = None) -> None:
        """Under the lock: forgets the attempt; its instances are told once the lock is released. Its
        span (a traced request's) ends with `outcome`, and `error` when it failed."""
        tracked.end_span(outcome, error)
        self.by_attempt.pop(tracked.attempt_id, None)
        for iid in (tracked.prefill_id, tracked.decode_id):
            client = self.client(iid) if iid is not None else None
            if client is not None:
                self.deferred.append((client.abort, tracked.attempt_id))

    def finish(self, tracked: Tracked, event: StreamEvent) -> None:
        """Under the lock: the request (choice) ends with `event`; a parent with it, when its last
        choice ended."""
        if not tracked.done:
            tracked.done = True
            tracked.end_span(event.finish_reason or "", event.error)
            # a choice's: its decode's, after what its parent's placement measured (queue, prefill)
            parent = tracked.parent.timings if tracked.parent is not None else {}
            event = replace(event, timings={**parent, **tracked.timings} or None, num_preemptions=tracked.preemptions)
            if self.live.get(tracked.request_id) is tracked:
                del self.live[tracked.request_id]
            tracked.stream.put(event)
            if tracked.parent is not None and all(c.done for c in tracked.parent.choices):
                self.finish(tracked.parent, event)


@dataclass
class StreamEvent:
    token_ids: list[int]  # new output tokens, in order, never repeated
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    extras: list[dict] | None = None  # one per token, when asked for (engine/core/extras.py: logprobs)
    index: int = 0  # the choice (n > 1)
    bad_request: bool = False  # the error is the request's own (an instance refused it): HTTP 400
    # with an attempt's first token: its prompt tokens served from a prefix cache (usage's cached_tokens)
    num_cached_tokens: int | None = None
    timings: dict[str, float] | None = None  # with the end: the request's phase seconds (PHASES)
    num_preemptions: int = 0  # with the end: how often its decode instances preempted it


class RequestStream:
    """Iterate for events; `result()` waits for the end. Thread-safe producer side (`put`).

    With a `listener`, events go to it instead (called on the router's threads: an asyncio
    consumer passes `lambda e: loop.call_soon_threadsafe(queue.put_nowait, e)`)."""

    def __init__(self, request_id: str, listener: Callable[[StreamEvent], None] | None = None):
        self.request_id, self.listener = request_id, listener
        self._events: queue.Queue[StreamEvent] = queue.Queue()
        self.token_ids: list[int] = []
        self.extras: list[dict] = []  # one per token, when the request asked for any
        self.num_cached_tokens = 0  # the latest attempt's prompt tokens served from a prefix cache
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_preemptions = 0  # with its end: how often its decode instances preempted it
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None  # when the router produced the first token
        self.finished_at_s: float | None = None  # when the router produced the end
        self.finished_s: float | None = None  # finished_at_s, once the consumer has read the end

    @property
    def logprobs(self) -> list[dict[int, float]]:
        """One {token id: logprob} per token read so far (the sampled token first), when asked for."""
        return [e["logprobs"] for e in self.extras]

    def put(self, event: StreamEvent) -> None:
        now = time.monotonic()  # stamped when produced, not when a (maybe busy) consumer reads it
        if event.token_ids and self.first_token_s is None:
            self.first_token_s = now
        if event.finished:
            self.finished_at_s = now
        if self.listener is not None:
            self.listener(event)
        else:
            self._events.put(event)

    def get(self, timeout: float | None = None) -> StreamEvent:
        """The next event; raises queue.Empty after `timeout`."""
        event = self._events.get(timeout=timeout)
        self.token_ids += event.token_ids
        self.extras += event.extras or []
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.finished:
            self.finish_reason, self.error, self.finished_s = event.finish_reason, event.error, self.finished_at_s
            self.num_preemptions = event.num_preemptions
        return event

    def __iter__(self):
        while True:
            event = self.get()
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> "RequestStream":
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.finished_s is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.get(timeout=left)
        return self


def indexed(listener: Callable[[StreamEvent], None] | None, index: int):
    """`listener` with the choice's index set on each event (n > 1)."""
    if listener is None:
        return None

    def put(event: StreamEvent) -> None:
        event.index = index
        listener(event)
    return put


@dataclass
class Tracked:
    """The router's record of one request across attempts (a failed pair is retried elsewhere)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    delivered: list[int] = field(default_factory=list)  # output tokens the client has
    attempt: int = 0
    base: int = 0  # len(delivered) when this attempt started
    prefill_id: str | None = None
    decode_id: str | None = None
    excluded: set[str] = field(default_factory=set)  # instances that failed this request
    decoding: bool = False  # this attempt's decode instance has its KV (it reported tokens)
    held: list = field(default_factory=list)  # outputs that came before the tokens ahead of them (RequestOutput)
    placing: tuple[str, ...] = ()  # while a placement's calls are out: the instances it may start on
    recompute_on: str | None = None  # the next attempt prefills on this decode instance (its KV load failed)
    session: str | None = None  # its session (x-session-id or user): placed where the session's last request was
    tenant: str = ""  # who it is for (its API key's name): fair shares within its class (router/flow.py)
    weight: float = 1.0  # its tenant's weight
    done: bool = False
    # n > 1: a parent is placed once for its choices (it has no stream of its own); a choice follows its
    # parent's placement (`grouped`) until that fails, then goes on as a request of its own
    choices: list["Tracked"] = field(default_factory=list, compare=False, repr=False)
    parent: "Tracked | None" = field(default=None, compare=False, repr=False)
    index: int = 0
    grouped: bool = False
    # tracing (engine/core/tracing.py): the request's own span's traceparent ("": not traced), its open attempt's
    # span, when it was submitted (time.time_ns()); and its phase seconds (PHASES) as the instances report them
    trace: str = ""
    span: object = field(default=None, compare=False, repr=False)
    submitted_ns: int = field(default_factory=time.time_ns)
    timings: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0  # on its decode instances, over its attempts

    def end_span(self, outcome: str, error: str | None = None) -> None:
        """Ends the attempt's span, if one is open."""
        span, self.span = self.span, None
        tracing.end(span, attributes={"pdserve.outcome": outcome}, error=error)

    @property
    def num_attempt_tokens(self) -> int:
        """Output tokens this attempt has delivered: the position its next token takes."""
        return len(self.delivered) - self.base

    @property
    def attempt_id(self) -> str:
        """The id the instances see: a late message from an earlier attempt can't be mistaken."""
        if self.grouped:  # the id the decode instance gives the choice when it forks
            return choice_id(self.parent.attempt_id, self.index)
        return f"{self.request_id}#{self.attempt}"
