"""bench/decode_layouts.py runs both layouts and restores the backend's rule after."""
from __future__ import annotations

import json

from bench import decode_layouts
from engine.attention.torch_backend import TorchAttentionBackend


def test_both_layouts_are_timed_and_the_rule_restored(capsys):
    decode_layouts.main(["--shapes", "2x32", "--rounds", "2", "--calls", "2"])
    out = json.loads(capsys.readouterr().out)
    row = out["layouts"]["2x32"]
    assert row["gqa_us"] > 0 and row["grouped_us"] > 0
    assert TorchAttentionBackend.GROUPED_DECODE_DEVICES == ("cuda",)
