"""The shifting-mix simulation (bench/shifting_mix.py) with this machine's measured profile, cold start
and flip (bench/results/flip_2026-12-07.json): on a fixed fleet the planner that flips meets the SLO
again after the mix shifts back to long prompts, where the one that only adds and removes does not
within the phase; on an unbounded fleet both meet it alike. And the script's command line."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.shifting_mix import FLEET, measured_profile, run, summary

ROOT = Path(__file__).resolve().parents[2]
PROFILE, TIMES = ROOT / "bench/profiles/smollm2-cpu.json", ROOT / "bench/results/flip_2026-12-07.json"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flips_meet_the_slo_sooner_on_a_fixed_fleet(seed):
    profile = measured_profile(str(PROFILE), str(TIMES))
    assert profile.startup_s == pytest.approx(6.506) and profile.flip_s < 0.2
    flips, adds = (summary(run(profile, f, FLEET, seed)) for f in (True, False))
    assert flips["requests"] > 500 and flips["moves"]["flip"] >= 2 and flips["moves"]["add"] == 0
    assert flips["attainment"] > adds["attainment"] + 0.2
    back_flip, back_add = flips["recovery_s"][1], adds["recovery_s"][1]  # after the shift to long prompts
    assert back_flip < 200 and (back_add == math.inf or back_add > back_flip + 60)
    assert flips["attainment_after_shift"][1] > adds["attainment_after_shift"][1] + 0.3


def test_an_unbounded_fleet_meets_the_slo_either_way():
    profile = measured_profile(str(PROFILE), str(TIMES))
    flips, adds = (summary(run(profile, f, 0, 0)) for f in (True, False))
    assert flips["moves"]["flip"] >= 1 and adds["moves"]["flip"] == 0
    assert min(flips["attainment"], adds["attainment"]) > 0.95


def test_command_line_writes_rows(tmp_path):
    out = tmp_path / "shift.json"
    subprocess.run([sys.executable, "-m", "bench.shifting_mix", "--profile", str(PROFILE), "--times", str(TIMES),
                    "--seeds", "1", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["startup_s"] == pytest.approx(6.506) and len(data["rows"]) == 4
    assert {(r["fleet"], r["flips"]) for r in data["rows"]} == {(FLEET, True), (FLEET, False), (0, True), (0, False)}
