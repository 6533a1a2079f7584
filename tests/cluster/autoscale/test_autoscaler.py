"""The autoscaling policies on hand-made observations: queue-inclusive TTFT, decode sizing by TBT
and KV, bounds, cool-downs and hysteresis; and the online profile from instance counters."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.autoscale.actuators import DryRunActuator, PoolSizes
from cluster.autoscale.autoscale_loop import OnlineProfile
from cluster.autoscale.autoscaler import Observation, Profile, QueueThreshold, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import fit_line
from router.client import InstanceInfo, InstanceLoad

PROFILE = Profile(prefill_tokens_per_s=1000.0, decode_itl_base_s=0.02, decode_itl_per_seq_s=0.001,
                  max_num_seqs=128, kv_capacity_tokens=100_000)
LIMITS = ScalingLimits(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8, headroom=0.2,
                       scale_up_cooldown_s=10, scale_down_cooldown_s=60)


def obs(now=0.0, sizes=PoolSizes(1, 1), rate=1.0, prompt=500, output=100, **kw) -> Observation:
    return Observation(now=now, sizes=sizes, arrival_rate=rate, mean_prompt_tokens=prompt,
                       mean_uncached_tokens=kw.pop("uncached", prompt), mean_output_tokens=output, **kw)


def planner(**kw) -> SLOPlanner:
    return SLOPlanner(PROFILE, kw.pop("limits", LIMITS), kw.pop("ttft", 2.0), kw.pop("tbt", 0.05))


def test_predicted_ttft_includes_queueing_and_backlog():
    """Service 0.5 s; at 1.6 req/s one instance is at 80% and waits 1 s more (M/D/1); a queued
    backlog adds its drain time; past saturation the prediction is infinite."""
    p = planner()
    assert p.predicted_ttft(2, obs(rate=1.6)) == pytest.approx(0.5 + 0.4 * 0.5 / (2 * 0.6))
    assert p.predicted_ttft(1, obs(rate=1.6)) == pytest.approx(0.5 + 0.8 * 0.5 / 0.4)
    assert p.predicted_ttft(1, obs(rate=0.1, queued_prefill_tokens=5000)) > 5.0
    assert p.predicted_ttft(1, obs(rate=2.0)) == float("inf")


def target(o: Observation, pool: str) -> int:
    """A fresh planner's scale-up target (a planner averages the rates it has seen)."""
    return planner().targets(o)[pool][0]


def test_prefill_follows_arrival_rate_prefix_hits_and_backlog():
    small, big = (target(obs(rate=r), "prefill") for r in (0.5, 6.0))
    assert small == 1 and big >= 4
    assert target(obs(rate=6.0, uncached=100), "prefill") == 1  # prefix cache hits need less prefill
    assert target(obs(rate=0.5, queued_prefill_tokens=20_000), "prefill") > small  # Dynamo misses this


def test_decode_sized_by_tbt_batch_and_kv():
    """TBT 50 ms allows batches of 30 (20 ms + 1 ms/seq); 10 req/s x 100 tokens x 50 ms = 50
    sequences (x1.2 headroom) -> 2 instances; 4,100-token sequences need KV for 3."""
    assert PROFILE.max_batch(0.05) == 30
    assert target(obs(rate=10.0), "decode") == 2
    assert target(obs(rate=10.0, prompt=4000, uncached=100), "decode") == 3
    assert target(obs(rate=0.1, sizes=PoolSizes(1, 2), decode_kv_usage=0.9), "decode") >= 3


def test_bounds_cooldown_and_one_step_scale_down():
    """Up: straight to the target (capped), at most once per 10 s. Down: only once the peak rate
    of the last 60 s fits fewer instances and has for 60 s, one instance at a time."""
    p = planner()
    assert p.decide(obs(now=0, rate=100.0)) == PoolSizes(8, 8)
    assert p.decide(obs(now=5, sizes=PoolSizes(8, 8), rate=0.0)) == PoolSizes(8, 8)
    assert p.decide(obs(now=70, sizes=PoolSizes(8, 8), rate=0.0)) == PoolSizes(8, 8)  # low since 70 only
    assert p.decide(obs(now=131, sizes=PoolSizes(8, 8), rate=0.0)) == PoolSizes(7, 7)
    assert p.decide(obs(now=135, sizes=PoolSizes(7, 7), rate=100.0)) == PoolSizes(7, 7)  # up cool-down
    assert p.decide(obs(now=141, sizes=PoolSizes(7, 7), rate=100.0)) == PoolSizes(8, 8)


def test_noisy_load_near_a_boundary_does_not_flap():
    """A load that wobbles around what 2 prefill instances need: the planner goes up once and the
    hysteresis band keeps it from shrinking back and forth."""
    p = planner(limits=ScalingLimits(max_prefill=8, max_decode=8, scale_up_cooldown_s=0, scale_down_cooldown_s=30))
    sizes, changes = PoolSizes(1, 1), 0
    for step in range(200):
        rate = 1.7 if step % 2 else 2.1
        new = p.decide(obs(now=step * 5.0, sizes=sizes, rate=rate))
        changes += new.prefill != sizes.prefill
        sizes = new
    assert changes == 1


def test_queue_threshold_reacts_one_step_at_a_time():
    q = QueueThreshold(ScalingLimits(scale_up_cooldown_s=0, scale_down_cooldown_s=0))
    assert q.decide(obs(now=0, queued_prefill_tokens=10_000, decode_waiting=3)) == PoolSizes(2, 2)
    assert q.decide(obs(now=1, sizes=PoolSizes(2, 2), queued_prefill_tokens=0, decode_kv_usage=0.1)) == PoolSizes(1, 1)


def test_profile_file_round_trip_and_fit(tmp_path):
    PROFILE.save(tmp_path / "p.json", model="x")
    assert Profile.load(tmp_path / "p.json") == PROFILE
    (tmp_path / "bad.json").write_text('{"prefill_tokens_per_s": 1}')
    with pytest.raises(ValueError, match="decode_itl_base_s"):
        Profile.load(tmp_path / "bad.json")
    assert fit_line([(1, 0.03), (10, 0.12), (20, 0.22)]) == pytest.approx((0.02, 0.01))
    assert fit_line([(4, 0.1), (4, 0.3)]) == pytest.approx((0.2, 0.0))  # one batch size: a flat line


def test_online_profile_from_instance_counters():
    """Prefill tokens per busy second and a step-time line through decode intervals."""
    infos = {"p": InstanceInfo("p", "prefill", 1), "d": InstanceInfo("d", "decode", 1)}
    cluster = SimpleNamespace(instance_infos=lambda: list(infos.values()))  # a ClusterView's (router/view.py)
    online = OnlineProfile(max_num_seqs=64)
    assert online.update(cluster) is None
    loads = [({"prefill_tokens_computed": 2000.0, "prefill_busy_s": 2.0},
              {"decode_steps": 10.0, "decode_step_s": 0.3, "decode_step_seqs": 10.0, "kv_capacity_tokens": 5000.0}),
             ({"prefill_tokens_computed": 4000.0, "prefill_busy_s": 4.0},
              {"decode_steps": 20.0, "decode_step_s": 1.5, "decode_step_seqs": 110.0, "kv_capacity_tokens": 5000.0})]
    for p_load, d_load in loads:
        infos["p"].load, infos["d"].load = InstanceLoad.of(p_load), InstanceLoad.of(d_load)
        profile = online.update(cluster)
    assert profile.prefill_tokens_per_s == pytest.approx(1000.0)
    assert profile.decode_itl_base_s == pytest.approx(0.02) and profile.decode_itl_per_seq_s == pytest.approx(0.01)
    assert profile.kv_capacity_tokens == 5000


def test_dry_run_actuator_records_without_acting(caplog):
    a = DryRunActuator(PoolSizes(1, 1))
    with caplog.at_level("INFO"):
        a.apply(PoolSizes(2, 1))
    assert a.current() == PoolSizes(2, 1) and "1P1D -> 2P1D" in caplog.text
