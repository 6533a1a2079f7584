"""bench/flex_steps.py times both backends on the steps asked for and prints one JSON object."""
from __future__ import annotations

import json

import pytest
import torch

from bench import flex_steps
from engine.attention.flex_backend import flex_unavailable


@pytest.mark.skipif(flex_unavailable(torch.device("cpu")) is not None, reason="flex cannot compile here")
def test_rows_name_each_step_with_both_times(capsys, monkeypatch):
    """The families' tiny heads (4 on 2, head_dim 32: a graph tests/engine/attention/test_flex_backend.py
    compiles too) on two steps of one padded shape: each row has both backends' times, the
    ratio and the padded shape. The inductor setting it changes is restored after (a monkeypatch
    of inductor's config deletes the key on undo: every later compile in the process failed)."""
    import torch._inductor.config as inductor_config
    before = inductor_config.compile_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's own thread count stays
    flex_steps.main(["--steps", "decode_1x256,decode_8x256", "--reps", "1", "--layers", "1",
                     "--heads", "4", "--kv-heads", "2", "--head-dim", "32"])
    out = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in out["steps"]] == ["decode_1x256", "decode_8x256"]
    for row in out["steps"]:
        assert row["flex_ms"] > 0 and row["torch_ms"] > 0 and row["flex_over_torch"] > 0
        assert row["padded"] == [256, 2048]
    assert inductor_config.compile_threads == before
