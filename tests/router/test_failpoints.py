"""The router's failpoint (router/failures.py), the chaos run's `router_fault`: armed by
SIGUSR2 where PDSERVE_FAILPOINTS=sigusr2, it makes the next router handler raise once, and the
guards fail that one request alone; unset, SIGUSR2 is not taken; another value is refused."""
from __future__ import annotations

import os
import signal

import pytest

from router.failures import ENV, Failpoints, InjectedFault
from tests.router.test_router import FakeDecode, FakePrefill, _wait_until
from tests.router.test_router_guards import PARAMS, feed, new_router

pytestmark = pytest.mark.timeout(60)


def test_sigusr2_fails_exactly_one_request_through_the_guards(monkeypatch):
    monkeypatch.setenv(ENV, "sigusr2")
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        p, d = FakePrefill("p0"), FakeDecode("d0", capacity=3)
        r = new_router(p, d)
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_until(lambda: r.failpoints.armed == 1, timeout_s=10)
        r.start()
        streams, fed = [r.submit(rid, [1, 2, 3], PARAMS) for rid in "abc"], set()
        _wait_until(lambda: feed(p, d, fed) or all(s.finished_at_s for s in streams), timeout_s=10)
        ends = sorted(s.result(timeout=10).finish_reason for s in streams)
        assert ends == ["error", "length", "length"] and r.failpoints.fired == 1
        assert sum(r.handler_errors.values()) == 1 and r.failpoints.armed == 0
        r.close()
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_unset_takes_no_signal_and_another_mode_is_refused(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    points = Failpoints.from_env()
    assert signal.getsignal(signal.SIGUSR2) is before
    points.check("place")  # unarmed: nothing
    points.arm()
    with pytest.raises(InjectedFault):
        points.check("place")
    monkeypatch.setenv(ENV, "always")
    with pytest.raises(ValueError, match="PDSERVE_FAILPOINTS='always'"):
        Failpoints.from_env()
