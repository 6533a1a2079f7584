"""The control-plane benchmark's short run (bench/control_plane.py): 10 and 100 simulated instances,
two gateway processes, a real Redis and Ray, the real controller, routers and planner: every figure
measured, every request answered, an added instance attached and a silent one dropped by both
gateways, a load step met by the planner with exactly the instances it needs. And
the simulated instances against the instance interface the router and controller use."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)
FIGURES = ("controller_start_s", "gateways_ready_s", "gateway_cpu_idle", "gateway_cpu_ms_per_request",
           "controller_cpu_idle", "probe_cycle_s_p50", "probe_cycle_s_p99", "redis_ops_per_s_idle",
           "router_decision_ms_p50", "router_decision_ms_p99", "gateway_rps", "redis_ops_per_s_load",
           "new_instance_visible_s", "dead_instance_visible_s", "dead_instance_replaced_s")


def test_ten_and_a_hundred_instances_two_gateways(tmp_path):
    ttl = 2.0
    run = subprocess.run([sys.executable, "-m", "bench.control_plane", "--instances", "10,100", "--gateways", "2",
                          "--load-s", "3", "--idle-s", "2", "--heartbeat-ttl", str(ttl), "--cold-start", "1", "--json",
                          "--plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["instances"], r["gateways"]) for r in rows] == [(10, 2), (100, 2)]
    for row in rows:
        assert all(row[key] is not None and row[key] >= 0 for key in FIGURES), row
        assert row["requests_completed"] > 10 and row["request_errors"] == 0, row
        assert row["router_decision_ms_p50"] > 0 and row["probe_cycle_s_p50"] > 0, row
        # found silent by the controller's probe (within its TTL) and dropped by both gateways at their next sync
        assert row["dead_instance_visible_s"] < 10 * (ttl + ttl / 3 + 0.5), row
        assert row["new_instance_visible_s"] < 30, row
        # the real planner, a tenth more decode instances (started at once, 1 s each): there, and no more
        before = row["planner_decode_before"]
        assert before > row["instances"] // 2 and row["planner_errors"] == 0, row  # (with the one added above)
        assert row["planner_step_instances"] == max(1, before // 10), row
        assert row["planner_decode_after"] == before + row["planner_step_instances"], row
        assert row["planner_converged_s"] < 60, row
    assert rows[1]["redis_ops_per_s_idle"] > rows[0]["redis_ops_per_s_idle"]  # probes and syncs grow with them
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"{k}.png" for k in (
        "router_decision_ms_p50", "router_decision_ms_p99", "gateway_rps", "redis_ops_per_s_idle",
        "redis_ops_per_s_load", "probe_cycle_s_p50", "new_instance_visible_s", "dead_instance_visible_s",
        "gateways_ready_s", "gateway_cpu_idle", "gateway_cpu_ms_per_request", "controller_cpu_idle",
        "planner_converged_s", "dead_instance_replaced_s"))


def test_simulated_instances_answer_as_the_router_expects():
    """On one host (no Ray): a decode instance reserves room up to max_num_seqs, a prefill instance
    computes at the profile's tokens/s and hands the first token to its router and the KV to the
    decode instance, which emits the rest one per step, positions counted from 1, the last finished."""
    import asyncio
    from dataclasses import asdict

    from bench.sim_instances import SimHost
    from cluster.autoscale.autoscaler import Profile
    from engine.core.request import RequestMessage, SamplingParams
    from kvtransfer.params import KVEndpoint, KVTransferParams

    profile = Profile(prefill_tokens_per_s=1000.0, decode_itl_base_s=0.01, decode_itl_per_seq_s=0.0,
                      max_num_seqs=2, kv_capacity_tokens=1000)

    async def scenario():
        host = SimHost(asdict(profile), 1, "test")
        await host.create("prefill-0", "prefill")
        await host.create("decode-0", "decode")
        msgs = [RequestMessage(f"r{k}", list(range(50)), SamplingParams(max_tokens=3), "router-a") for k in range(3)]
        assert [await host.call("decode-0", "reserve", m, 1) is not None for m in msgs] == [True, True, False]
        kv = KVTransferParams("r0", "decode-0", 1, (KVEndpoint("decode-0", 0, "127.0.0.1", 1),))
        await host.call("prefill-0", "submit", msgs[0], kv)
        assert (await host.call("prefill-0", "load"))["queued_prefill_tokens"] == 50
        first = await host.call("prefill-0", "poll_outputs", 1.0, "router-a")
        assert [(r.request_id, r.first_token) for r in first] == [("r0", 1)]
        outputs = []
        while not (outputs and outputs[-1].finished):
            outputs += await host.call("decode-0", "poll_outputs", 1.0, "router-a")
        assert [(o.start, o.finished) for o in outputs] == [(1, False), (2, True)]
        load = await host.call("decode-0", "load")
        assert load["running"] == 0 and load["reserved"] == 1 and load["decode_steps"] == 2
        assert await host.call("prefill-0", "poll_outputs", 0.01, "router-b") == []  # another router's: none

    asyncio.run(scenario())
