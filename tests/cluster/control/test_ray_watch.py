"""A joined controller or gateway whose Ray node is no longer alive in its Ray cluster (the head
restarted: a new, empty cluster) exits once that has lasted its grace period, and not before:
a short outage (a cut link, the head restarting) is ridden out."""
from __future__ import annotations

import time

from cluster.control.ray_watch import RayMembershipWatch


def watch(answers: list[bool], grace_s: float) -> tuple[RayMembershipWatch, list[float]]:
    calls: list[float] = []
    seq = iter(answers)
    w = RayMembershipWatch(lambda: next(seq, answers[-1]), on_lost=lambda: calls.append(time.monotonic()),
                           interval_s=0.01, grace_s=grace_s, what="test")
    return w.start(), calls


def wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_gone_for_the_grace_period_calls_on_lost_once():
    w, calls = watch([True, False], grace_s=0.1)
    wait(lambda: calls)
    time.sleep(0.1)
    assert len(calls) == 1 and w.lost


def test_a_short_absence_is_ridden_out():
    w, calls = watch([True, False, False, True], grace_s=5.0)
    time.sleep(0.3)
    w.stop()
    assert calls == [] and not w.lost

