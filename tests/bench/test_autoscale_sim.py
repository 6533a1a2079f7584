"""The load-trace simulation with this machine's measured SmolLM2 profile: the SLO planner follows
a ramp, a spike and a fall with a bounded number of changes and meets the SLOs far more often than
the queue-threshold policy on the same trace."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.autoscale_sim import STANDARD_TRACE, simulate
from cluster.autoscale.autoscaler import Profile, QueueThreshold, ScalingLimits, SLOPlanner

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "profiles" / "smollm2-cpu.json"
LIMITS = ScalingLimits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, headroom=0.2,
                       scale_up_cooldown_s=10, scale_down_cooldown_s=60)


def sizes_at(timeline, t: float) -> tuple[int, int]:
    return next((p, d) for when, _, p, d in reversed(timeline) if when <= t)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slo_planner_follows_the_trace_and_beats_queue_threshold(seed):
    profile = Profile.load(PROFILE)
    planner = simulate(SLOPlanner(profile, LIMITS, ttft_slo_s=4.0, tbt_slo_s=0.3), profile, seed=seed)
    baseline = simulate(QueueThreshold(LIMITS), profile, ttft_slo_s=4.0, tbt_slo_s=0.3, seed=seed)
    assert planner.num_requests > 1000
    assert planner.attainment >= 0.95 and planner.attainment > baseline.attainment + 0.15
    spike_end = sum(ph.duration_s for ph in STANDARD_TRACE[:4])
    quiet, spike, end = (sizes_at(planner.timeline, t) for t in (100, spike_end, planner.timeline[-1][0]))
    assert quiet[0] <= 2 and quiet[1] == 1 and spike[0] >= 4 and spike[1] >= 2  # follows the load up...
    assert end[0] <= 2 and end[1] == 1  # ...and back down
    assert planner.changes <= 20 and planner.reversals <= 6  # no oscillation
