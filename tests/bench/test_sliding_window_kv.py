"""bench.sliding_window_kv on a short prompt: the window ships W - 1 tokens and holds fewer
blocks; full attention ships the whole prompt and holds it all."""
from __future__ import annotations

import json

from bench.sliding_window_kv import main


def test_window_against_full_attention(capsys):
    assert main(["--prompt-len", "300", "--window", "64", "--max-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    window, full = out["window"], out["full"]
    assert window["tokens_transferred"] == 63 and full["tokens_transferred"] == 300
    bs = window["block_size"]
    assert window["decode_blocks_held_peak"] <= -(-64 // bs) + 1 < full["decode_blocks_held_peak"]
    assert full["decode_blocks_held_peak"] == -(-323 // bs) and full["blocks_freed_while_decoding"] == 0
    # the reserve skipped blocks before position 237; decoding to position 322 freed those before 259
    assert window["blocks_freed_while_decoding"] == 259 // bs - 237 // bs
