"""Priority classes in an instance's queues (issue 54; vLLM's `priority` scheduling policy).

A request's class is its `SamplingParams.priority`: a lower value is served first; 0 by default. Both
schedulers keep their waiting queue ordered by class, then arrival (`enqueue`): a new request goes
behind every request of its class, a preempted one ahead of them (it was admitted before them). With
every request in one class (the default), the queues are first come, first served, as before.

A decode instance also gives a more urgent class room: the running request of the lowest class
(the highest value; in it, the last admitted) is the one preempted when blocks run out, and the
most urgent request that waits, here or as a reservation refused for want of room (`RoomWanted`),
takes seats and blocks from running requests of a lower class (decode_worker/scheduler.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request

ROOM_WANTED_S = 1.0  # a refused reservation's claim on room lasts this long (the router retries within 50 ms)


def enqueue(queue: deque[Request], req: Request, ahead: bool = False) -> None:
    """Puts `req` in `queue` (ordered by class, lower first): behind every request of its class, or
    (`ahead`: a preempted one) before them. O(1) when the tail (the head) is of its class or above."""
    p = req.priority
    if ahead:
        i = 0
        while i < len(queue) and queue[i].priority < p:
            i += 1
    else:
        i = len(queue)
        while i > 0 and queue[i - 1].priority > p:
            i -= 1
    queue.insert(i, req)


def by_class(running: list[Request]) -> list[Request]:
    """`running` ordered by class, the order within a class kept (admission): its tail is then the
    request to preempt first (the lowest class's last admitted). The same list when it is in order
    (always, with one class), else a new one: never sorted in place, where a reader on another
    thread (load figures) would see it empty while the sort runs."""
    if all(a.priority <= b.priority for a, b in zip(running, running[1:])):
        return running
    return sorted(running, key=_priority)


def _priority(req: Request) -> int:
    return req.priority


@dataclass(frozen=True)
class RoomWanted:
    """What a request of class `priority` needs to start: `seats` sequences and `blocks` KV blocks;
    claimed until time.monotonic() passes `until`."""
    priority: int
    seats: int
    blocks: int
    until: float
