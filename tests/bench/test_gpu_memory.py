"""bench/gpu_memory.py's dry run: the KV budget section of the GPU check on its CPU stand-in (a
pretend device, a 2-layer tiny Llama), in a process that has only what the GPU machine has, as
bench/gpu_check.py would run it. The pool comes from the stand-in's numbers: 0.07 of 1 GiB less its
64 MiB context = 8053063 bytes, in blocks of 2 layers x 2 x 16 tokens x 2 KV heads x 32 x 2 bytes
= 8 KiB: 983."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.test_gpu_check import BLOCKER, REPO

SCRIPT = "import json; from bench.gpu_memory import memory; from bench.gpu_sections import Plan; " \
         "print(json.dumps(memory(Plan.dry_run())))"


@pytest.mark.timeout(180)
def test_dry_run_sizes_the_pool_from_the_stand_in_and_runs_the_decode_ladder(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = out["budget"]
    assert budget["kv_blocks"] == 983 and budget["limited_by"] == "share"
    assert budget["context_gib"] == round(64 / 1024, 3) and budget["profiled"] == {
        "prefill_tokens": 512, "decode_seqs": 4, "context_len": 512}
    assert out["backend"] == "torch" and out["cuda_graphs"] is False and out["max_model_len"] == 512
    assert out["ladder"] == {"1": {"ok": True, "peak_reserved_gib": 0.0}, "4": {"ok": True, "peak_reserved_gib": 0.0}}
    assert out["largest_decode_batch_at_max_model_len"] == 4 and out["reserved"]["within_budget"]
