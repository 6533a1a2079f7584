"""The planner's moves (cluster/autoscale/autoscaler.py Policy.decide): a pool that must grow takes the
other pool's spare instances by flipping them when a flip serves sooner than a cold start or the fleet
is full, else adds; a full fleet moves one instance from the pool meeting its SLO to the one missing
it; a rate forecast one cold start ahead asks for a standby; no pool shrinks quicker than a cold start."""
from __future__ import annotations

from dataclasses import replace

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscaler import Observation, Profile, QueueThreshold, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import LinearTrend

# service of a 500-token prompt 0.5 s; the largest batch meeting a 50 ms TBT is 30
PROFILE = Profile(prefill_tokens_per_s=1000.0, decode_itl_base_s=0.02, decode_itl_per_seq_s=0.001,
                  max_num_seqs=128, kv_capacity_tokens=100_000, startup_s=30.0, flip_s=1.0)
LIMITS = ScalingLimits(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8, headroom=0.2,
                       scale_up_cooldown_s=10, scale_down_cooldown_s=60)


def obs(sizes: PoolSizes, rate=1.0, prompt=500, output=100, now=100.0, **kw) -> Observation:
    return Observation(now=now, sizes=sizes, arrival_rate=rate, mean_prompt_tokens=prompt,
                       mean_uncached_tokens=prompt, mean_output_tokens=output, **kw)


def planner(profile=PROFILE, limits=LIMITS, **kw) -> SLOPlanner:
    return SLOPlanner(profile, limits, ttft_slo_s=2.0, tbt_slo_s=0.05, **kw)


# 1 req/s of 500-token prompts needs one prefill instance; 70 sequences decoding need three decode ones
DECODE_SHORT = dict(sizes=PoolSizes(3, 1), decode_running=70)


def test_spare_prefill_instances_flip_to_decode_at_once():
    """The flip (1 s and an empty queue) beats a 30 s cold start: two prefill instances flip now, with
    no scale-down quiet time to wait for (the decision grows one pool by what the other gives)."""
    p = planner()
    assert p.flip_time("prefill", obs(**DECODE_SHORT)) == 1.0
    assert p.decide(obs(**DECODE_SHORT)) == PoolSizes(1, 3)
    assert p.moves == {"flip": 2, "add": 0, "remove": 0}


def test_without_flips_the_pool_grows_by_adding():
    p = planner(flips=False)
    assert p.decide(obs(**DECODE_SHORT)) == PoolSizes(3, 3)  # the spare prefill waits for its quiet time
    assert p.moves == {"flip": 0, "add": 2, "remove": 0}


def test_a_cold_start_quicker_than_the_flip_adds():
    """A flip of 40 s (or a queue that long to drain) against a 30 s cold start: add."""
    assert planner().flip_time("prefill", obs(**DECODE_SHORT, queued_prefill_tokens=3000)) == 2.0
    p = planner(profile=replace(PROFILE, flip_s=40.0))
    assert p.decide(obs(**DECODE_SHORT)) == PoolSizes(3, 3) and p.moves == {"flip": 0, "add": 2, "remove": 0}


def test_a_full_fleet_flips_even_when_slower_and_never_adds_past_it():
    limits, slow = replace(LIMITS, max_instances=4), replace(PROFILE, flip_s=40.0)
    o = obs(**DECODE_SHORT)
    assert planner(slow, limits, flips=False).decide(o) == PoolSizes(3, 1)  # no room to add
    p = planner(slow, limits)
    assert p.decide(o) == PoolSizes(1, 3) and p.moves["flip"] == 2


def test_a_full_fleet_gives_the_pool_missing_its_slo_one_the_other_can_spare():
    """1P3D on a fleet of 4: 3 req/s overload the one prefill instance (TTFT infinite) while 55
    sequences on two decode instances would still step within the TBT (27.5 each: 47.5 ms). No pool
    has spare at its target with headroom; the decode pool gives one anyway."""
    p = planner(limits=replace(LIMITS, max_instances=4))
    o = obs(PoolSizes(1, 3), rate=3.0, decode_running=55)
    assert p.targets(o)["decode"][0] == 3 and not p.meets_slo("prefill", 1, o) and p.meets_slo("decode", 2, o)
    assert p.decide(o) == PoolSizes(2, 2) and p.moves["flip"] == 1
    crowded = obs(PoolSizes(1, 3), rate=3.0, decode_running=80)  # two could not step within the TBT
    assert planner(limits=replace(LIMITS, max_instances=4)).decide(crowded) == PoolSizes(1, 3)


def test_the_queue_threshold_policy_never_flips():
    p = QueueThreshold(LIMITS)
    assert p.flip_time("prefill", obs(**DECODE_SHORT)) is None
    assert p.decide(obs(PoolSizes(3, 1), decode_waiting=5, queued_prefill_tokens=0)) == PoolSizes(3, 2)
    assert p.moves == {"flip": 0, "add": 1, "remove": 0}


def test_a_rising_forecast_asks_for_a_standby_and_holds_it():
    """A ramp of +0.4 req/s every 10 s: one cold start (30 s) ahead, the rate is 1.2 req/s higher than
    the mean now, so the planner with a forecast asks for a prefill instance more than the one without."""
    plain, ahead = planner(), planner(forecaster=LinearTrend(10.0))
    for k in range(6):
        o = obs(PoolSizes(1, 1), rate=0.4 + 0.4 * k, now=10.0 * k)
        without, with_forecast = plain.targets(o), ahead.targets(o)
    assert with_forecast["prefill"][0] > without["prefill"][0] and ahead.standby["prefill"] >= 1
    assert with_forecast["prefill"][1] >= with_forecast["prefill"][0]  # (not shrunk away while it holds)


def test_no_pool_shrinks_quicker_than_a_cold_start():
    """A 60 s scale-down quiet time but a 90 s cold start: the lower target must hold 90 s."""
    p = planner(profile=replace(PROFILE, startup_s=90.0))
    quiet = dict(sizes=PoolSizes(3, 1), rate=0.1)
    assert p.decide(obs(**quiet, now=1000.0)) == PoolSizes(3, 1)
    assert p.decide(obs(**quiet, now=1070.0)) == PoolSizes(3, 1)
    assert p.decide(obs(**quiet, now=1090.0)) == PoolSizes(2, 1)
