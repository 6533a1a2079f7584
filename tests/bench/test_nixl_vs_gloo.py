"""bench/nixl_vs_gloo.py's transfer section, small: both transports move a request from a prefill
pool to a decode process, and each row reports their rates and the prefill side's CPU."""
from __future__ import annotations

import json

import pytest

from bench import nixl_vs_gloo
from kvtransfer.nixl_agent import nixl_unavailable

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))]


def test_json_rows_have_both_transports(capsys):
    assert nixl_vs_gloo.main(["--tokens", "64", "--layers", "2", "--rounds", "1", "--reps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [row] = result["transfer"]
    assert row["tokens"] == 64 and row["bytes_per_request"] == 2 * 64 * 3 * 64 * 2 * 2
    assert all(row[f"{n}_{k}"] > 0 for n in ("gloo", "nixl") for k in ("GBps", "ms_per_request", "step_ms_per_request"))
    assert result["receiver_stats"]["nixl"]["parts_read_direct"] == 2  # warm-up and the timed one
    assert result["receiver_stats"]["gloo"]["completed"] == 2 and result["two_hosts"] == result["ttft"] == []
