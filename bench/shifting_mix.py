"""A load whose request mix shifts (long prompts and short answers, then short prompts and long
answers, then back), simulated with this machine's measured profile, flip time and cold start: the
SLO planner that may flip instances between the pools against the same planner that only adds and
removes them, on a fixed fleet (`max_instances`) and on an unbounded one.

    python -m bench.shifting_mix --profile bench/profiles/smollm2-cpu.json \\
        --times bench/results/flip_2026-12-07.json --json out.json

`--times` is what `python -m bench.flip --json` wrote: its cold start (an instance added to a running
cluster, to serving) and its flip (the median rebuild; the drain the simulation models itself).
Figures: SLO attainment over the trace and after each shift, seconds from a shift until the SLO is met
again (three 10 s windows in a row at 90 %), instance-seconds, and the planner's flips, adds and removes.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from bench.autoscale_sim import Phase, SimResult, recovered_after, simulate
from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscaler import Profile, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import LinearTrend

PREFILL_HEAVY, DECODE_HEAVY = (512, 16), (64, 512)  # (prompt, output) tokens
# rates in units of one prefill instance's capacity at 512-token prompts (bench/autoscale_sim.py)
SHIFTING_TRACE = (Phase(120, 1.5, 1.5, *PREFILL_HEAVY), Phase(300, 0.6, 0.6, *DECODE_HEAVY),
                  Phase(300, 1.5, 1.5, *PREFILL_HEAVY))
SHIFTS_S = (120.0, 420.0)
START = PoolSizes(3, 1)  # the first phase's steady state
FLEET = 4
TTFT_SLO_S, TBT_SLO_S = 4.0, 0.3


def run(profile: Profile, flips: bool, fleet: int, seed: int = 0) -> SimResult:
    limits = ScalingLimits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, headroom=0.2,
                           scale_up_cooldown_s=10, scale_down_cooldown_s=60, max_instances=fleet)
    planner = SLOPlanner(profile, limits, TTFT_SLO_S, TBT_SLO_S, forecaster=LinearTrend(10.0), flips=flips)
    return simulate(planner, profile, SHIFTING_TRACE, ttft_slo_s=TTFT_SLO_S, tbt_slo_s=TBT_SLO_S, start=START,
                    seed=seed, flips=flips)


def summary(result: SimResult) -> dict:
    def met(t0: float, t1: float) -> float:
        rows = [(n, frac) for start, n, frac in result.windows if t0 <= start < t1]
        return sum(n * frac for n, frac in rows) / max(sum(n for n, _ in rows), 1)

    ends = (*SHIFTS_S[1:], sum(ph.duration_s for ph in SHIFTING_TRACE))
    return {"attainment": round(result.attainment, 4),
            "attainment_after_shift": [round(met(t0, t1), 4) for t0, t1 in zip(SHIFTS_S, ends)],
            "recovery_s": [recovered_after(result, t0) for t0 in SHIFTS_S],
            "instance_seconds": round(result.instance_seconds), "moves": result.moves,
            "requests": result.num_requests, "timeline": result.timeline}


def measured_profile(profile_path: str, times_path: str | None) -> Profile:
    profile = Profile.load(profile_path)
    if times_path is None:
        return profile
    times = json.loads(open(times_path).read())
    return replace(profile, startup_s=times["cold_start_s"], flip_s=times["rebuild_median_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="JSON written by `pdserve bench --profile`")
    ap.add_argument("--times", help="JSON written by `python -m bench.flip --json` (cold start and flip)")
    ap.add_argument("--startup-s", type=float, help="a cold start to simulate instead of the measured one")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", help="write the rows (with timelines) here")
    args = ap.parse_args()
    profile = measured_profile(args.profile, args.times)
    if args.startup_s is not None:
        profile = replace(profile, startup_s=args.startup_s)
    rows = []
    print(f"cold start {profile.startup_s:.2f} s, flip {profile.flip_s:.3f} s (+ drain)")
    print(f"{'fleet':<7}{'planner':<12}{'seed':>5}{'SLO met':>9}{'after shifts':>16}{'recovery s':>14}"
          f"{'inst-s':>8}  moves")
    for fleet in (FLEET, 0):
        for flips in (True, False):
            for seed in range(args.seeds):
                row = {"fleet": fleet, "flips": flips, "seed": seed, **summary(run(profile, flips, fleet, seed))}
                rows.append(row)
                after = "/".join(f"{a:.0%}" for a in row["attainment_after_shift"])
                rec = "/".join(f"{r:.0f}" for r in row["recovery_s"])
                print(f"{fleet or 'none':<7}{'flip' if flips else 'add/remove':<12}{seed:>5}{row['attainment']:>9.1%}"
                      f"{after:>16}{rec:>14}{row['instance_seconds']:>8}  {row['moves']}")
    if args.json:
        with open(args.json, "w") as f:  # (a row per line)
            f.write(f'{{"startup_s": {profile.startup_s}, "flip_s": {profile.flip_s}, "rows": [\n')
            f.write(",\n".join(json.dumps(row) for row in rows) + "\n]}\n")


if __name__ == "__main__":
    main()
