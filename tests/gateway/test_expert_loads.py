"""A mixture of experts' loads through the gateway, over a real in-process cluster: /status gives
each instance's tokens per expert per sparse layer, /metrics the imbalance per layer."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from tests.helpers import FAMILIES, random_prompts, save_tiny

pytestmark = pytest.mark.timeout(180)


def test_status_counts_every_routed_token_and_metrics_show_the_imbalance(tmp_path):
    """Two completions of 20 and 31 prompt tokens, 4 generated each, colocated: every sparse
    layer (0 and 2 of Qwen3-MoE's 3; 1 is in mlp_only_layers) counted top_k = 2 experts for each of
    the 20 + 31 + 2 * 3 computed tokens (a sampled token is computed once it is fed back: 3 of 4);
    the imbalance gauge per layer is max over mean of those counts."""
    kind, switches = FAMILIES["qwen3_moe"]
    folder = save_tiny(tmp_path / "moe", kind, seed=3, **switches)
    spec = ClusterSpec(model=str(folder), dtype="float32", device="cpu", mode="colocated", num_prefill=0,
                       num_kv_blocks=64, max_num_seqs=4, num_threads=1)
    tokenizer = Tokenizer.from_path(resolve_model_path("smollm2"))  # only for the app: prompts are token ids
    with Cluster(spec, use_ray=False) as cluster:
        client = TestClient(create_app(cluster, tokenizer, "moe", 512))
        for prompt in random_prompts(2, [20, 31], seed=4):
            r = client.post("/v1/completions", json={"model": "moe", "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        (instance,) = client.get("/status").json()["instances"]
        counts = instance["expert_counts"]
        want = {layer: max(c) / (sum(c) / len(c)) for layer, c in counts.items()}
        deadline = time.monotonic() + 30
        while (got := _imbalance(client.get("/metrics").text, instance["instance_id"])) != pytest.approx(want) \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # the router refreshes the instances' load figures on its own beat
    assert sorted(counts) == ["0", "2"] and all(len(c) == 8 for c in counts.values())
    assert [sum(c) for c in counts.values()] == [2 * (20 + 31 + 2 * 3)] * 2
    assert got == pytest.approx(want), (got, want)


def _imbalance(metrics: str, instance_id: str) -> dict[str, float]:
    """layer -> the instance's pdserve_instance_expert_imbalance_ratio."""
    head = f'pdserve_instance_expert_imbalance_ratio{{instance_id="{instance_id}",layer="'
    return {line[len(head):].split('"')[0]: float(line.split()[-1])
            for line in metrics.splitlines() if line.startswith(head)}
