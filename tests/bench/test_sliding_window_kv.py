"""bench.sliding_window_kv on a short prompt: a window ships W - 1 tokens of each sliding layer
and holds fewer blocks; full attention ships the whole prompt and holds it all; Gemma 2's global
layers keep every token beside its sliding ones."""
from __future__ import annotations

import json

from bench.sliding_window_kv import main


def test_window_against_full_attention(capsys):
    assert main(["--prompt-len", "300", "--window", "64", "--max-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    window, full = out["mistral_window"], out["mistral_full"]
    assert window["tokens_transferred"] == 63 and full["tokens_transferred"] == 300
    bs = window["block_size"]
    assert window["decode_blocks_held_peak"] <= -(-64 // bs) + 1 < full["decode_blocks_held_peak"]
    assert full["decode_blocks_held_peak"] == -(-323 // bs) and full["blocks_freed_while_decoding"] == 0
    # the reserve skipped blocks before position 237; decoding to position 322 freed those before 259
    assert window["blocks_freed_while_decoding"] == 259 // bs - 237 // bs
    # Gemma 2, layers sliding, global, sliding, global: two KV groups of 2 layers
    mixed, all_global = out["gemma2_window"], out["gemma2_full"]
    assert mixed["kv_layout"] == "64x2,fullx2" and all_global["kv_layout"] == "fullx4"
    assert mixed["layer_tokens_transferred"] == 2 * 63 + 2 * 300 and all_global["layer_tokens_transferred"] == 4 * 300
    # a block holds 2 layers: the global group's 323 tokens, the sliding group's window span
    assert mixed["decode_layer_tokens_held_peak"] <= 2 * bs * (-(-323 // bs) + -(-64 // bs) + 1)
    assert all_global["decode_layer_tokens_held_peak"] == 4 * bs * -(-323 // bs)
    assert mixed["blocks_freed_while_decoding"] == window["blocks_freed_while_decoding"]
