"""A short chaos run (bench/chaos.py) on the Helm chart's pods: faults of every kind, some two at
once, under a steady load of streaming chat and completion requests. No invariant may break: every
request the colocated text or an explicit error within the deadline, the cluster back at its spec
after each fault and at the end, every KV block free, no pod's memory past its bound. The 10-minute
run is a benchmark (BENCHMARKS.md)."""
from __future__ import annotations

import json

import pytest

from bench.chaos import Chaos, ChaosConfig

pytestmark = pytest.mark.timeout(900)
DURATION_S = 120.0


def test_two_minutes_of_faults_under_load_break_no_invariant(chart):
    log = Chaos(chart, ChaosConfig(duration_s=DURATION_S, seed=1)).run()
    summary = log["summary"]
    print(json.dumps(summary))
    assert summary["faults_injected"] >= 3 and summary["faults_failed_to_inject"] == 0, log["faults"]
    assert summary["violations"] == 0, log["violations"][:10]
    assert summary["requests_by_outcome"].get("ok", 0) >= 10, summary
    assert all(f["recovery_s"] is not None for f in log["faults"]), log["faults"]
