"""Session affinity (router/policy.py SessionAffinity): a session's request goes where its last one
ran, whatever the policy, while that instance is healthy and has room; otherwise the policy picks
and the session follows the new instance."""
from __future__ import annotations

import pytest

from router.policy import SessionAffinity
from tests.router.test_router import PARAMS, FakeDecode, FakePrefill, _wait_until, make_router

pytestmark = pytest.mark.timeout(60)


def _placed(r, request_id: str, session: str | None, prefills, decodes) -> tuple[str, str]:
    """Submits one request; (prefill id, decode id) it was placed on."""
    r.submit(request_id, [1, 2, 3], PARAMS, session=session)
    p = next(p.info.instance_id for p in prefills if any(m.request_id.startswith(request_id) for m, _ in p.submitted))
    d = next(d.info.instance_id for d in decodes if any(m.request_id.startswith(request_id) for m in d.reserved))
    return p, d


def test_a_sessions_requests_stay_on_its_pair_while_round_robin_spreads_the_rest():
    prefills, decodes = [FakePrefill("p0"), FakePrefill("p1")], [FakeDecode("d0"), FakeDecode("d1"), FakeDecode("d2")]
    r = make_router(prefills, decodes)  # round robin
    try:
        first = _placed(r, "a0", "chat-a", prefills, decodes)
        others = [_placed(r, f"x{i}", None, prefills, decodes) for i in range(3)]
        again = [_placed(r, f"a{i}", "chat-a", prefills, decodes) for i in range(1, 4)]
        assert again == [first] * 3
        assert len({d for _, d in others}) == 3  # without a session: spread as before
        assert r.stats["session_placements"] == 3  # the first request of a session is not one
        b = _placed(r, "b0", "chat-b", prefills, decodes)
        assert _placed(r, "b1", "chat-b", prefills, decodes) == b
    finally:
        r.close()


def test_a_dead_or_full_instance_passes_the_session_on_and_it_follows():
    prefills, decodes = [FakePrefill("p0")], [FakeDecode("d0"), FakeDecode("d1"), FakeDecode("d2")]
    r = make_router(prefills, decodes)
    try:
        _, home = _placed(r, "a0", "s", prefills, decodes)
        by_id = {d.info.instance_id: d for d in decodes}
        by_id[home].capacity = len(by_id[home].reserved)  # full: the reservation is refused
        _, moved = _placed(r, "a1", "s", prefills, decodes)
        assert moved != home
        assert _placed(r, "a2", "s", prefills, decodes)[1] == moved  # the session follows
        by_id[moved].dead = True  # found dead at the next reservation: placed again elsewhere
        r.submit("a3", [1, 2, 3], PARAMS, session="s")
        alive = [d for d in decodes if d.info.instance_id != moved]
        _wait_until(lambda: any(m.request_id.startswith("a3") for d in alive for m in d.reserved))  # the retry
        last = next(d.info.instance_id for d in alive if any(m.request_id.startswith("a3") for m in d.reserved))
        assert _placed(r, "a4", "s", prefills, decodes)[1] == last
    finally:
        r.close()


def test_sessions_expire_after_the_ttl_and_the_oldest_leave_first_past_the_bound():
    now = [0.0]
    s = SessionAffinity(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    assert s.placed("a", "p0", "d0") is False and s.served("a") == ("p0", "d0")
    assert s.placed("a", "p0", "d0") is True and s.placed("a", "p1", "d0") is False
    s.placed("b", None, "d1")
    s.placed("a", "p1", "d0")  # a used last: b is the oldest
    s.placed("c", None, "d2")
    assert s.served("b") is None and s.served("a") == ("p1", "d0") and len(s) == 2
    now[0] = 10.5
    assert s.served("c") is None and s.served("a") is None
