"""bench/flip.py on a tiny random model (Ray, 2P1D): it measures a cold start and each flip, idle and
under load, and every loaded flip's requests end well."""
from __future__ import annotations

import argparse

from bench import flip
from tests.helpers import local_ray, save_tiny_llama


def test_flip_bench_smoke(tmp_path):
    model = str(save_tiny_llama(tmp_path / "tiny"))
    with local_ray():
        out = flip.run(argparse.Namespace(model=model, flips=1, load_requests=4))
    assert out["cold_start_s"] > 0 and len(out["flips"]) == 2 and all(f["ok"] for f in out["flips"])
    assert [f["to"] for f in out["flips"]] == ["decode", "prefill"]
    assert out["flip_idle_median_s"] >= out["rebuild_median_s"] / 2 > 0
