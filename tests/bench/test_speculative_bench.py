"""bench/speculative.py runs and reports what BENCHMARKS.md quotes (few tokens, small batches)."""
from __future__ import annotations

import json

import pytest

from bench import speculative

pytestmark = pytest.mark.timeout(300)


def test_rows_per_method_workload_and_batch_with_acceptance_and_the_profile(capsys):
    """Every method's row per workload and batch, the ratio to plain decoding, the acceptance per
    position and the limit after the run; the draft made of the target's first 2 layers."""
    assert speculative.main(["--methods", "none", "ngram", "draft_model", "--draft", "layers:2", "--workloads",
                             "copying", "--batches", "2", "--max-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    methods = result["methods"]
    assert set(methods) == {"none", "ngram", "draft_model"}
    for method in ("ngram", "draft_model"):
        for key in ("copying/b2",):
            row = methods[method][key]
            assert row["decode_tok_s"] > 0 and row["over_none"] > 0 and len(row["acceptance"]) == 3
            assert row["tokens"] == methods["none"][key]["tokens"]  # greedy: the same outputs' lengths
        assert methods[method]["profile"].startswith("batch: decode/verify+propose ms 1: ")
    assert methods["ngram"]["copying/b2"]["proposed"][0] > 0
