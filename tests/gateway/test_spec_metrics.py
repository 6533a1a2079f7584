"""Speculative decoding through the gateway, over a real in-process cluster: /metrics gives the
drafts proposed and accepted per method and position, and the acceptance; /status the config."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from tests.helpers import random_prompts, save_tiny

pytestmark = pytest.mark.timeout(180)


def test_metrics_count_drafts_per_method_and_position(tmp_path):
    folder = save_tiny(tmp_path / "tiny", seed=3)
    spec = ClusterSpec(model=str(folder), dtype="float32", device="cpu", mode="colocated", num_prefill=0,
                       num_kv_blocks=64, max_num_seqs=4, num_threads=1, speculative_method="ngram",
                       num_speculative_tokens=2, speculative_max_batch_size=4)
    tokenizer = Tokenizer.from_path(resolve_model_path("smollm2"))  # only for the app: prompts are token ids
    with Cluster(spec, use_ray=False) as cluster:
        client = TestClient(create_app(cluster, tokenizer, "tiny", 512))
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": random_prompts(1, [9], seed=4)[0] * 4,
                                                 "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while True:  # the router refreshes the instances' load figures on its own beat
            (instance,) = client.get("/status").json()["instances"]
            load, got = instance["load"], _figures(client.get("/metrics").text)
            if load.get("spec_proposed/ngram/0") and got == _want(load) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert instance["engine"]["speculative"].startswith("ngram, 2 tokens; on at up to 4 decoding sequences")
    assert load["spec_proposed/ngram/0"] > 0 and load["spec_max_batch"] == 4
    assert got == _want(load)


def _want(load: dict) -> dict:
    return {(name, position): load.get(f"{key}/ngram/{position}") for key, name in _NAMES.items() for position in "01"}


_NAMES = {"spec_proposed": "pdserve_spec_decode_proposed_tokens_total",
          "spec_accepted": "pdserve_spec_decode_accepted_tokens_total",
          "spec_acceptance": "pdserve_spec_decode_acceptance_ratio"}


def _figures(metrics: str) -> dict:
    """(metric, position) -> value, of the method ngram."""
    out = {}
    for line in metrics.splitlines():
        name = line.split("{")[0]
        if name in _NAMES.values() and 'method="ngram"' in line:
            out[(name, line.split('position="')[1].split('"')[0])] = float(line.split()[-1])
    return out
