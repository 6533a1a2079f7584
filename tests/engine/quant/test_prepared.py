"""The prepared-layer cache (engine/quant/prepared.py): a model whose int4 layers and Q8_0 head are read
back from the cache computes bit for bit the logits of one that prepared them, and a cache that is
stale (the checkpoint changed), corrupt, of another key or short of a layer is logged, not used where
it does not apply, and written again."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.gguf_types import write_llama_gguf
from engine.quant.integer import Int4PackKernel
from engine.runner.model_runner import ModelRunner
from tests.helpers import all_logits, engine_config, random_prompts, save_tiny_llama

pytestmark = pytest.mark.skipif(Int4PackKernel().unavailable(torch.device("cpu")) is not None,
                                reason="no int4pack kernel in this torch build")
LAYERS = 2
TYPES = {f"blk.{i}.{n}": "Q4_1" for i in range(LAYERS)
         for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
TYPES |= {"token_embd": "Q8_0", "output": "Q8_0"}  # the head runs from its Q8_0 blocks (engine/quant/q8_head.py)
PROMPT = random_prompts(1, [40], seed=3)[0]


@pytest.fixture
def gguf_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # its float conversion: this test's own
    monkeypatch.setenv("PDSERVE_PREPARED_CACHE_DIR", str(tmp_path / "prepared"))
    return write_llama_gguf(tmp_path / "tiny.gguf", TYPES, hidden=128, ffn=256, layers=LAYERS, heads=4, kv_heads=2,
                            vocab=256)


def load(path, caplog) -> tuple[torch.Tensor, str]:
    """The logits at every position of PROMPT, and what the prepared-layer cache logged."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.quant.prepared"):
        runner = ModelRunner(engine_config(model=str(path), dtype="bfloat16", num_blocks=16))
    layers = runner.linear_layers
    assert "int4" in layers and "Q8_0" in layers, layers  # both cached methods run
    return all_logits(runner, PROMPT, 16), caplog.text


def files(path) -> list:
    return sorted((path.parent / "prepared").glob("prepared-*.safetensors"))


def test_layers_read_back_give_the_logits_of_layers_prepared(gguf_path, caplog, monkeypatch):
    """Uncached, first load (prepares and writes), second load (reads): the same logits, bit for bit."""
    monkeypatch.setenv("PDSERVE_PREPARED_CACHE", "0")
    uncached, log = load(gguf_path, caplog)
    assert "off, PDSERVE_PREPARED_CACHE=0" in log and files(gguf_path) == []
    monkeypatch.delenv("PDSERVE_PREPARED_CACHE")
    first, log = load(gguf_path, caplog)
    assert log.count("none cached at") == 2 and log.count("written to") == 2 and len(files(gguf_path)) == 2
    second, log = load(gguf_path, caplog)
    assert "prepared layers (int4, 8): read from" in log and "prepared layers (q8_0 head, 1): read from" in log
    assert torch.equal(first, uncached) and torch.equal(second, uncached)


def test_a_changed_checkpoint_is_a_new_key_and_the_old_file_goes(gguf_path, caplog):
    """The GGUF's mtime changed (a new download in place): its layers are prepared again, the files
    of the old key removed."""
    want, _ = load(gguf_path, caplog)
    old = files(gguf_path)
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    got, log = load(gguf_path, caplog)
    assert log.count("none cached at") == 2 and log.count("(an older key of the same slot)") == 2
    assert len(files(gguf_path)) == 2 and not set(old) & set(files(gguf_path))
    assert torch.equal(got, want)


@pytest.mark.parametrize("damage", ["garbage", "other key", "a layer short"])
def test_a_damaged_file_is_logged_prepared_again_and_rewritten(gguf_path, caplog, damage):
    """Bytes that are no safetensors file, a file whose stored key differs, a file lacking a layer:
    each is said in a warning, the layers are prepared, the logits stay the same, and the next load
    reads the rewritten file."""
    want, _ = load(gguf_path, caplog)
    for target in files(gguf_path):  # the int4 layers' file (the other holds the head)
        with safe_open(target, framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k).clone() for k in f.keys()}, f.metadata()
        if '"int4"' in meta["key"]:
            break
    if damage == "garbage":
        target.write_bytes(b"\x00" * 100)
    elif damage == "other key":
        save_file(tensors, target, metadata={**meta, "key": meta["key"].replace('"int4"', '"int8"')})
    else:
        save_file({k: v for k, v in tensors.items() if "layers.1.mlp.down_proj|" not in k}, target,
                  metadata=meta)
    got, log = load(gguf_path, caplog)
    expected = {"garbage": "unreadable", "other key": "holds other layers", "a layer short": "lacks layers.1.mlp.down_proj"}
    assert expected[damage] in log and "prepared layers (int4): written to" in log
    assert torch.equal(got, want)
    again, log = load(gguf_path, caplog)
    assert "prepared layers (int4, 8): read from" in log and torch.equal(again, want)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_float_checkpoint_quantized_at_load(tmp_path, caplog, monkeypatch, quantization):
    """A safetensors folder quantized at load (int8: `int8pack` and `reference` keep the same codes,
    written once): read back, the same logits as prepared."""
    monkeypatch.setenv("PDSERVE_PREPARED_CACHE_DIR", str(tmp_path / "prepared"))
    folder = save_tiny_llama(tmp_path / "tiny")
    logits = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.quant.prepared"):
            runner = ModelRunner(engine_config(model=str(folder), dtype="float32", num_blocks=16,
                                               quantization=quantization))
        logits.append(all_logits(runner, PROMPT[:20], 8))
    assert f"prepared layers ({quantization}, " in caplog.text and "read from" in caplog.text
    assert torch.equal(logits[0], logits[1])


def test_a_kernel_state_of_more_than_tensors_is_not_cached_and_says_so(tmp_path, caplog, monkeypatch):
    """w8a8's fbgemm keeps packed parameters, not tensors: its layers are prepared at every load, logged."""
    monkeypatch.setenv("PDSERVE_PREPARED_CACHE_DIR", str(tmp_path / "prepared"))
    folder = save_tiny_llama(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="engine.quant.prepared"):
        runner = ModelRunner(engine_config(model=str(folder), dtype="float32", num_blocks=16, quantization="w8a8"))
    if "fbgemm" not in runner.linear_layers:
        pytest.skip("fbgemm not chosen on this machine")
    assert "not cached: kernel fbgemm keeps more than plain tensors" in caplog.text
    assert list((tmp_path / "prepared").glob("*.safetensors")) == []


def test_an_unwritable_cache_is_said_and_the_model_serves_uncached(gguf_path, tmp_path, caplog, monkeypatch):
    """A cache folder that cannot be made (a file stands in its way): a warning per file, the same logits."""
    want, _ = load(gguf_path, caplog)
    (tmp_path / "blocked").write_text("a file, not a folder")
    monkeypatch.setenv("PDSERVE_PREPARED_CACHE_DIR", str(tmp_path / "blocked" / "prepared"))
    got, log = load(gguf_path, caplog)
    assert log.count("cannot write") == 2 and torch.equal(got, want)
