"""The autoscaler loop on a live in-process cluster (tiny model): observations from the router
and instance loads, a decision, the RayActuator acting on it, metrics on the gateway."""
from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscale_loop import create_autoscaler
from cluster.autoscale.autoscaler import Profile
from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams
from gateway.metrics import GatewayMetrics
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(180)


def test_slo_planner_grows_and_shrinks_a_live_cluster(tiny_path, tmp_path):
    """A profile that says one prefill instance does 50 tokens/s: 8 requests of 60 tokens in an
    interval ask for more prefill capacity than one instance has, so the planner adds one (capped
    at max_prefill=2); with no load it drains it again. Metrics show desired and current sizes."""
    Profile(prefill_tokens_per_s=50.0, decode_itl_base_s=0.001, decode_itl_per_seq_s=0.0001, max_num_seqs=16,
            kv_capacity_tokens=1000).save(tmp_path / "profile.json")
    spec = ClusterSpec(model=tiny_path, dtype="float32", device="cpu", num_kv_blocks=128, block_size=8,
                       max_num_seqs=16, max_num_batched_tokens=128, num_threads=1, autoscale=True,
                       autoscale_profile=str(tmp_path / "profile.json"), ttft_slo_s=5.0, tbt_slo_s=1.0,
                       max_prefill=2, max_decode=1, scale_up_cooldown_s=0, scale_down_cooldown_s=0,
                       autoscale_interval_s=0.1)  # steps are called by hand; this sets a 0.3 s rate window
    with Cluster(spec, use_ray=False) as c:
        scaler = create_autoscaler(c, spec)
        c.autoscaler = scaler
        metrics = GatewayMetrics(c)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        c.generate(random_prompts(8, [60], seed=1), params, timeout_s=60)
        assert scaler.step() == PoolSizes(2, 1)
        assert sorted(c.instances) == ["decode-0", "prefill-0", "prefill-1"]
        assert scaler.last.arrival_rate > 0 and scaler.last.mean_prompt_tokens == 60
        text = generate_latest(metrics.registry).decode()
        assert 'pdserve_autoscaler_desired_instances{role="prefill"} 2.0' in text
        assert 'pdserve_autoscaler_decisions_total{direction="up",role="prefill"} 1.0' in text
        assert "pdserve_autoscaler_predicted_ttft_seconds" in text
        assert all(s.error is None for s in c.generate(random_prompts(4, [20], seed=2), params, timeout_s=60))
        assert scaler.step() == PoolSizes(2, 1)  # 4 short prompts in a short interval: still 2
        assert scaler.profile.startup_s == scaler.actuator.measured()["startup_s"] < 30  # the add, measured
        assert f'pdserve_autoscaler_start_seconds{{kind="cold"}} {scaler.profile.startup_s}' in \
            generate_latest(metrics.registry).decode()
        time.sleep(0.5)
        assert scaler.step() == PoolSizes(2, 1)  # nothing arrived since: a lower target, which must hold...
        time.sleep(scaler.profile.startup_s)  # ...for a cold start (what leaves could not come back sooner)
        assert scaler.step() == PoolSizes(1, 1)  # the pool shrinks by draining
        assert len([i for i in c.instances if i.startswith("prefill")]) == 1
        c.assert_no_leaks()
