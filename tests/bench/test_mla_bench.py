"""bench/mla_steps.py runs and reports what BENCHMARKS.md quotes (tiny shapes, one repetition)."""
from __future__ import annotations

import json

import pytest

from bench import mla_steps

pytestmark = pytest.mark.timeout(300)


def test_mla_steps_reports_bytes_forms_and_transfers(capsys):
    """The latent cache's bytes per token and layer, from the cache and from the transfer, are the
    entry's (kv_lora_rank + rope dim, fp32) and below the GQA model's; both decode forms timed."""
    assert mla_steps.main(["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--kv-lora-rank", "32",
                           "--nope-dim", "16", "--rope-dim", "8", "--mlp", "64", "--layers", "2", "--batches", "1,2",
                           "--contexts", "16", "--steps", "1", "--transfer-len", "32", "--transfers", "1",
                           "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    mla, gqa = result["kv_bytes_per_token_layer"]["mla"], result["kv_bytes_per_token_layer"]["gqa"]
    assert mla["cache"] == mla["transfer"] == (32 + 8) * 4
    assert gqa["cache"] == gqa["transfer"] == 2 * 2 * 16 * 4
    assert all(t["transfer_ms"] > 0 for t in result["transfer"].values())
    rows = result["decode_ms_per_step"]["16"]
    assert set(rows) == {"1", "2"} and all(ms["absorbed"] > 0 and ms["expanded"] > 0 for ms in rows.values())
