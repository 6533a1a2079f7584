"""bench/tenants.py without servers: each mode's keys file, the per-request costs it measures, and
its table."""
from __future__ import annotations

import json

from bench import tenants
from gateway.api_keys import load_api_keys


def test_keys_files_give_the_modes_their_classes(tmp_path):
    classes = {k.name: k.priority for k in load_api_keys(tenants.keys_file(tenants.MODES["classes"], tmp_path))}
    assert classes == {"chat": 0, "batch": 10, "a": 0, "b": 0}
    fair = {k.name: k.priority for k in load_api_keys(tenants.keys_file(tenants.MODES["fair"], tmp_path))}
    assert set(fair.values()) == {0} and tenants.MODES["fifo"] is None


def test_per_request_costs_and_table():
    costs = tenants.per_request_costs(n=500)
    assert {"deque_us", "flow_queue_1_tenants_us", "flow_queue_100_tenants_us", "limits_local_us"} <= set(costs)
    assert all(v > 0 for v in costs.values())
    mode = {"interactive": {"quiet_ttft_ms": {"p50": 1, "p99": 2}, "flood_ttft_ms": {"p50": 3, "p99": 4}},
            "share": {"b_share": 0.5}}
    text = tenants.table({"modes": {"fifo": mode}, "per_request": costs})
    assert "| fifo | 1 / 2 | 3 / 4 | 0.5 |" in text and json.dumps(costs) in text
