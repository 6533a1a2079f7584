"""/metrics shows what the router's guards caught and its threads' restarts, by label, from 0."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from gateway.metrics import GatewayMetrics
from router.policy import create_routing_policy
from router.router import Router
from router.tables import HANDLERS
from tests.gateway.test_api_keys import metric
from tests.router.test_router import FakeDecode, FakePrefill, _wait_until
from tests.router.test_router_guards import PARAMS, raising_once

pytestmark = pytest.mark.timeout(60)


def test_handler_errors_and_thread_restarts_are_on_metrics():
    """Every handler and thread kind has its series at 0 from the start; a placement that raised
    and a refresh loop that died count 1 each, under their own labels."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = Router([p], [d], create_routing_policy("round_robin"), poll_s=0.02)
    r._refresh_loads = raising_once(r._refresh_loads)
    r.start()
    metrics = GatewayMetrics(SimpleNamespace(router=r, instance_infos=list))
    text = generate_latest(metrics.registry).decode()
    for handler in HANDLERS:
        assert metric(text, "pdserve_router_handler_errors_total", handler=handler) == 0, handler
    r._place = raising_once(r._place)
    assert r.submit("a", [1, 2, 3], PARAMS).result(timeout=10).finish_reason == "error"
    _wait_until(lambda: r.thread_restarts["refresh_loads"] == 1, timeout_s=10)
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "pdserve_router_handler_errors_total", handler="place") == 1
    assert metric(text, "pdserve_router_thread_restarts_total", thread="refresh_loads") == 1
    assert metric(text, "pdserve_router_thread_restarts_total", thread="place_pending") == 0
    assert metric(text, "pdserve_router_thread_restarts_total", thread="collect") == 0
    r.close()
