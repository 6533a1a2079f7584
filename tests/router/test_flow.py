"""The router's queue (router/flow.py): priority classes strictly, fair shares of work between
tenants within a class, retries ahead, and its bounds."""
from __future__ import annotations

from collections import Counter

import pytest

from engine.core.request import SamplingParams
from router.flow import FlowQueue, cost_of
from router.tables import RequestStream, Tracked


def tracked(rid: str, tenant: str = "", priority: int = 0, weight: float = 1.0, prompt: int = 10,
            max_tokens: int = 10, n: int = 1) -> Tracked:
    return Tracked(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens, priority=priority, n=n),
                   RequestStream(rid), tenant=tenant, weight=weight)


def drain(q: FlowQueue, k: int | None = None) -> list[str]:
    out = []
    while q and (k is None or len(out) < k):
        out.append(q.pop().tracked.request_id)
    return out


def test_one_tenant_one_class_is_first_come_first_placed():
    q = FlowQueue()
    for i in range(20):
        q.push(tracked(f"r{i}", prompt=1 + 7 * i % 13))
    assert drain(q) == [f"r{i}" for i in range(20)]


def test_a_flooding_tenant_waits_behind_its_own_backlog():
    """A queues 100 requests, then B 5: B's come out at once, alternating with A's."""
    q = FlowQueue()
    for i in range(100):
        q.push(tracked(f"a{i}", "A"))
    for i in range(5):
        q.push(tracked(f"b{i}", "B"))
    first = drain(q, 12)
    assert [r for r in first if r.startswith("b")] == [f"b{i}" for i in range(5)]
    assert first.index("b0") <= 2 and first.index("b4") <= 11


def test_shares_follow_weights_in_work_not_requests():
    """Both backlogged: A (weight 3) gets 3x B's tokens; B's requests are 4x larger, so A gets 12x
    as many requests."""
    q = FlowQueue()
    for i in range(400):
        q.push(tracked(f"a{i}", "A", weight=3.0, max_tokens=10))
        q.push(tracked(f"b{i}", "B", weight=1.0, max_tokens=70))
    work = Counter()
    for rid in drain(q, 200):
        work[rid[0]] += 20 if rid[0] == "a" else 80
    assert 2.7 <= work["a"] / work["b"] <= 3.3, work


def test_classes_are_strict_and_a_retry_leads_its_class():
    q = FlowQueue()
    q.push(tracked("batch", priority=10))
    q.push(tracked("chat", priority=0))
    q.push(tracked("chat2", priority=0))
    q.push(tracked("retry", priority=0), ahead=True)
    q.push(tracked("urgent", priority=-5))
    assert drain(q) == ["urgent", "retry", "chat", "chat2", "batch"]


def test_restored_request_keeps_its_place():
    q = FlowQueue()
    for i in range(3):
        q.push(tracked(f"r{i}", "A"))
    q.push(tracked("b", "B"))
    entry = q.pop()
    assert entry.tracked.request_id == "r0"
    q.restore(entry)  # fitted nowhere
    assert drain(q) == ["r0", "b", "r1", "r2"]


def test_bound_per_class_and_removal():
    q = FlowQueue(max_per_class=2)
    a, b = tracked("a"), tracked("b")
    q.push(a)
    q.push(b)
    assert q.full(0) and not q.full(1) and len(q) == 2
    q.remove(a)
    assert not q.full(0) and a not in q and b in q and drain(q) == ["b"]


def test_deadline_takes_requests_that_waited_too_long():
    now = [0.0]
    q = FlowQueue(timeout_s=5.0, clock=lambda: now[0])
    q.push(tracked("old"))
    now[0] = 3.0
    q.push(tracked("new"))
    entry = q.pop()  # "old" is being placed: out of the queue, then put back
    now[0] = 5.5
    assert q.expired() == []
    q.restore(entry)
    assert [t.request_id for t in q.expired()] == ["old"] and drain(q) == ["new"]


def test_cost_is_prompt_plus_n_times_max_tokens():
    assert cost_of(tracked("x", prompt=100, max_tokens=50, n=3)) == 250


def test_a_full_router_refuses_per_class_and_fails_what_waits_past_its_deadline():
    """A decode instance with no room: the queue holds one request per class (the next of that
    class is QueueFullError, another class's is queued), and each fails "queue_timeout" once it
    has waited 0.3 s; the router's counter says so."""
    from router.router import QueueFullError
    from tests.router.test_router import FakeDecode, FakePrefill, make_router
    r = make_router([FakePrefill("p0")], [FakeDecode("d0", capacity=0)], max_queued=1, queue_timeout_s=0.3)
    try:
        def params(priority: int) -> SamplingParams:
            return SamplingParams(max_tokens=3, priority=priority)
        first = r.submit("a", [1, 2, 3], params(0))
        with pytest.raises(QueueFullError, match="1 requests of priority 0 already queued"):
            r.submit("b", [1, 2, 3], params(0))
        other = r.submit("c", [1, 2, 3], params(5))
        for stream in (first, other):
            stream.result(10)
            assert stream.finish_reason == "error" and stream.error.startswith("queue_timeout"), stream.error
        assert r.snapshot()["queue_timeouts"] == 2 and r.num_queued == 0
    finally:
        r.close()
