"""bench/decode_steps.py: a tiny run prints one JSON object with a positive time per batch size
and the configuration that ran; bad sizes are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch

from bench import decode_steps


@pytest.fixture
def keep_num_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_json_smoke(capsys, keep_num_threads):
    assert decode_steps.main(["--batches", "1,2", "--steps", "2", "--prompt-len", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["ms_per_step"]) == {"1", "2"} and all(v > 0 for v in result["ms_per_step"].values())
    assert result["config"]["dtype"] in ("float32", "bfloat16") and result["config"]["attention"]


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        decode_steps.main(["--batches", "0"])
    assert "--steps and every batch size must be >= 1" in capsys.readouterr().err
