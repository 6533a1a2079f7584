"""The router's queue: requests waiting for a decode instance to take them (issue 54).

Order: by priority class first (`SamplingParams.priority`, lower first, strictly: a queued request
of a more urgent class is always placed before any of a lower one); within a class, start-time fair
queueing (Goyal et al., SFQ) over tenants (API keys), each with its weight. A request's cost is its
work in tokens, prompt + n x max_tokens; it is stamped on arrival with a start tag
S = max(V, F_tenant) and its tenant's finish tag moves to F_tenant = S + cost / weight; the smallest S
is placed first and the class's virtual time V becomes it. So a tenant that floods its class waits
behind its own backlog, and another tenant of that class gets at least weight / (sum of the
weights of the tenants with requests queued) of the work placed while both have requests queued,
however many the flooder sent. Within one tenant, first come, first placed. With one tenant and one
class (no keys, no priorities), the queue is first come, first placed, as it was.

A retry (an attempt that failed on its instances) goes ahead of its class: it was placed before.
A request that fits nowhere is put back (`restore`) with the tags it had. Bounds: `max_per_class`
requests per class (QueueFullError at the door: HTTP 429), and `timeout_s` queued (the router
fails it: 503); both with Retry-After.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.core.request import SamplingParams


class Tracked(Protocol):
    """What the queue reads of a request (router/tables.py Tracked)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    weight: float


QUEUE_TIMEOUT = "queue_timeout"  # how the error of a request that waited past the deadline starts


@dataclass
class _Entry:
    key: tuple  # (class, start tag, arrival sequence): heap order
    tracked: Tracked
    deadline: float = math.inf  # time.monotonic() past which it has waited too long


@dataclass
class _Class:
    vtime: float = 0.0  # the start tag of the request placed last
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> its last request's finish tag
    size: int = 0  # requests queued


class FlowQueue:
    """Requests waiting to be placed, by class then fair share (see the module). Not thread-safe:
    the router's lock guards it."""

    def __init__(self, max_per_class: int = 4096, timeout_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        self.max_per_class, self.timeout_s, self.clock = max_per_class, timeout_s, clock
        self._heap: list[tuple[tuple, _Entry]] = []  # by key; entries no longer queued are skipped
        self._entries: dict[int, _Entry] = {}  # id(tracked) -> its entry while queued
        self._classes: dict[int, _Class] = {}  # classes with requests queued
        self._deadlines: list[tuple[float, int, _Entry]] = []  # a heap (with a timeout)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, tracked: Tracked) -> bool:
        return id(tracked) in self._entries

    def __iter__(self):
        """The queued requests, in placement order (a copy)."""
        return iter([e.tracked for e in sorted(self._entries.values(), key=lambda e: e.key)])

    def size(self, priority: int) -> int:
        """Requests of class `priority` queued."""
        c = self._classes.get(priority)
        return 0 if c is None else c.size

    def full(self, priority: int) -> bool:
        """Whether class `priority` holds `max_per_class` requests (a new one is refused)."""
        return self.size(priority) >= self.max_per_class

    def push(self, tracked: Tracked, ahead: bool = False) -> None:
        """Queues a new request (tagged as the module says) or, `ahead`, a retry (before its class)."""
        p = tracked.params.priority
        c = self._classes.setdefault(p, _Class())
        seq = next(self._seq)
        if ahead:
            key = (p, -math.inf, seq)
        else:
            start = max(c.vtime, c.finish.get(tracked.tenant, 0.0))
            c.finish[tracked.tenant] = start + cost_of(tracked) / tracked.weight
            key = (p, start, seq)
        self._insert(_Entry(key, tracked, self.clock() + self.timeout_s))

    def restore(self, entry: _Entry) -> None:
        """Puts back a request `pop` gave (it fitted nowhere), with its tags and deadline."""
        p, start, _ = entry.key
        self._classes.setdefault(p, _Class(vtime=max(start, 0.0)))  # (its class emptied meanwhile)
        self._insert(entry)

    def _insert(self, entry: _Entry) -> None:
        self._entries[id(entry.tracked)] = entry
        self._classes[entry.key[0]].size += 1
        heapq.heappush(self._heap, (entry.key, entry))
        if entry.deadline < math.inf:
            heapq.heappush(self._deadlines, (entry.deadline, next(self._seq), entry))  # (a restore: again)

    def pop(self) -> _Entry | None:
        """The entry of the request to place next (`.tracked`), taken off the queue; `restore` it
        if the request fits nowhere."""
        while self._heap:
            _, entry = heapq.heappop(self._heap)
            if self._entries.get(id(entry.tracked)) is entry:
                c = self._classes[entry.key[0]]
                c.vtime = max(c.vtime, entry.key[1])
                self._take(entry)
                return entry
        return None

    def remove(self, tracked: Tracked) -> None:
        """Takes a request off the queue (aborted, stopped, failed); no-op when it is not queued."""
        entry = self._entries.get(id(tracked))
        if entry is not None:
            self._take(entry)

    def _take(self, entry: _Entry) -> None:
        del self._entries[id(entry.tracked)]
        c = self._classes[entry.key[0]]
        c.size -= 1
        if not c.size:  # its busy period ended: its tags start over with the next arrival
            del self._classes[entry.key[0]]
        if not self._entries:
            self._heap.clear()
            self._deadlines.clear()

    def expired(self) -> list[Tracked]:
        """The queued requests that have waited past their deadline, taken off the queue."""
        now, out = self.clock(), []
        while self._deadlines:
            deadline, _, entry = self._deadlines[0]
            if self._entries.get(id(entry.tracked)) is not entry:  # placed, or queued again under another
                heapq.heappop(self._deadlines)
            elif deadline <= now:
                heapq.heappop(self._deadlines)
                self._take(entry)
                out.append(entry.tracked)
            else:
                break
        return out


def cost_of(tracked: Tracked) -> int:
    """A request's work in tokens: its prompt and every choice's max_tokens."""
    return len(tracked.prompt_token_ids) + tracked.params.n * tracked.params.max_tokens
