"""The MoE benchmarks run and report what BENCHMARKS.md quotes (tiny shapes, few repetitions)."""
from __future__ import annotations

import json

import pytest

from bench import gpt_oss_steps, moe_parallel, moe_steps

pytestmark = pytest.mark.timeout(300)


def test_moe_steps_reports_both_models_and_every_expert_path(capsys):
    assert moe_steps.main(["--tiny", "--experts", "4", "--top-k", "2", "--expert-width", "32", "--batches", "1,4",
                           "--steps", "2", "--reps", "2", "--prompt-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["decode_ms_per_step"]) == {"1", "4"}
    assert all(r["moe"] > 0 and r["dense"] > 0 and r["moe_int8"] > 0 and r["moe_int4"] > 0
               for r in result["decode_ms_per_step"].values())
    for row in result["expert_paths_ms"].values():
        assert row["loop"] > 0 and row["grouped_mm"] > 0 and row["int8"] > 0 and row["int4"] > 0
        assert row["dense_same_flops"] > 0 and row["int4_kernel"] in ("int4pack", "int4pack_bf16", "reference")
        assert row["auto_runs"] in ("loop", "grouped_mm", "vllm_cpu") and 1 <= row["experts_touched"] <= 4
    assert result["auto_choice"].count("tokens") == 4
    sizes = result["expert_weight_bytes_per_layer"]
    assert sizes["float"] > max(sizes["int8"], sizes["int4"]) > 0  # int4 as the reference holds it: 1.25 bytes a weight


def test_moe_parallel_compares_every_layout_on_both_routings(capsys):
    """Two gloo ranks; the skewed routing's contiguous placement is counted as imbalanced, both
    plans' (with and without replicas) less so."""
    assert moe_parallel.main(["--experts", "8", "--top-k", "2", "--expert-width", "32", "--hidden", "64",
                              "--tokens", "64", "--reps", "2", "--json"]) == 0
    routings = json.loads(capsys.readouterr().out)["routings"]
    for kind in ("uniform", "skewed"):
        assert all(routings[kind][layout]["ms_per_call"] > 0 for layout in moe_parallel.LAYOUTS)
    skewed = routings["skewed"]
    assert skewed["ep"]["imbalance_counted"] > 1.2 > skewed["ep_planned"]["imbalance_counted"]
    assert skewed["ep_planned_replicas"]["imbalance_counted"] < skewed["ep"]["imbalance_counted"]


def test_gpt_oss_steps_reports_both_models_on_each_backend(capsys):
    """gpt-oss against Qwen3-MoE of its shape, per backend (torch and flex: the tiny heads have no
    vllm_cpu kernel)."""
    assert gpt_oss_steps.main(["--tiny", "--experts", "4", "--top-k", "2", "--expert-width", "32", "--window", "16",
                               "--batches", "1,4", "--steps", "2", "--prompt-len", "8", "--backends", "torch,flex",
                               "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["decode_ms_per_step"]) == {"torch", "flex"}
    for rows in result["decode_ms_per_step"].values():
        assert set(rows) == {"1", "4"} and all(r["gpt_oss"] > 0 and r["qwen3_moe"] > 0 for r in rows.values())
