"""The int8 linear method: its kernels against the plain-torch reference, its error against fp32,
and tensor-parallel shards quantized after loading."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.parallel.layers import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    TPGroup)
from engine.quant import create_linear_method, linear_layers, process_weights_after_loading, resolve_quantization
from engine.quant.integer import Int8LinearMethod, W8A8LinearMethod
from engine.quant.base import (FbgemmKernel, Int8PackKernel, ReferenceKernel, ReferenceW8A8Kernel, cpu_has_vnni,
                               dequantize, quantize_per_channel)

SHAPES = [(960, 576), (576, 1536), (48, 40)]  # SmolLM2's qkv and down_proj, and an odd small one


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def _input(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * 2 + 0.3  # not centred: fbgemm's zero point is exercised


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_per_channel_round_trip():
    """Every weight is within half its row's step of the dequantized value; int8 values stay in
    [-127, 127] and each row's largest magnitude maps to +-127; an all-zero row stays zero."""
    w = _weight((64, 96))
    w[5] = 0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert ((dequantize(q, scale, torch.float32) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert (q[5] == 0).all() and (q.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_int8pack_matches_reference(shape, m):
    """torch's `_weight_int8pack_mm` equals the plain-torch reference on the same int8 weights:
    to fp32 rounding in fp32, to bf16 rounding in bf16 (also from a misaligned view of the input);
    in bf16 it refuses in_features that are not a multiple of 16 (torch's kernel would crash)."""
    q, scale = quantize_per_channel(_weight(shape))
    x = _input(m, shape[1])
    ref = ReferenceKernel().run((q, scale), x)
    kernel = Int8PackKernel()
    assert _rel(kernel.run(kernel.prepare(q, scale, torch.float32), x), ref) < 1e-5
    if shape[1] % 16:
        assert "multiple of 16" in kernel.unsupported(shape, torch.bfloat16)
        return
    assert kernel.unsupported(shape, torch.bfloat16) is None
    state = kernel.prepare(q, scale, torch.bfloat16)
    assert _rel(kernel.run(state, x.bfloat16()), ref) < 1e-2
    misaligned = torch.cat([torch.zeros(m, 1), x], dim=1).bfloat16()[:, 1:]  # rows start 2 bytes off
    assert _rel(kernel.run(state, misaligned), ref) < 1e-2


@pytest.mark.skipif(FbgemmKernel().unavailable(torch.device("cpu")) is not None, reason="fbgemm needs x86")
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_fbgemm_matches_reference(shape, m, reduce_range):
    """fbgemm's dynamic int8 linear equals the reference applied to the activations as fbgemm
    quantizes them (per tensor, uint8, 7-bit with reduce_range) to 1e-5 relative; against the
    reference on the raw activations the activation rounding costs at most 3e-2 relative. With bf16
    activations the output is bf16 and within bf16 rounding of the same reference."""
    if not reduce_range and not cpu_has_vnni():
        pytest.skip("8-bit activations need VNNI (without it fbgemm's u8*s8 pair sums saturate, so the "
                    "kernel runs reduce_range there: engine/quant/base.py)")
    q, scale = quantize_per_channel(_weight(shape))
    x = _input(m, shape[1])
    kernel = FbgemmKernel(reduce_range=reduce_range)
    out = kernel.run(kernel.prepare(q, scale, torch.float32), x)
    x_as_quantized = torch.quantize_per_tensor_dynamic(x, torch.quint8, reduce_range).dequantize()
    assert _rel(out, ReferenceKernel().run((q, scale), x_as_quantized)) < 1e-5
    assert _rel(out, ReferenceW8A8Kernel(reduce_range).run((q, scale), x)) < 1e-5
    assert _rel(out, ReferenceKernel().run((q, scale), x)) < (3e-2 if reduce_range else 1.5e-2)
    x_bf16 = x.bfloat16()  # bf16 activations: fbgemm quantizes them as fp32 and returns bf16
    bf16 = kernel.run(kernel.prepare(q, scale, torch.bfloat16), x_bf16)
    as_quantized = torch.quantize_per_tensor_dynamic(x_bf16.float(), torch.quint8, reduce_range).dequantize()
    assert bf16.dtype == torch.bfloat16 and _rel(bf16, ReferenceKernel().run((q, scale), as_quantized)) < 5e-3


@pytest.mark.parametrize("method, kernel, bound", [(Int8LinearMethod, "reference", 1e-2), (Int8LinearMethod, "int8pack", 1e-2),
                                                   (W8A8LinearMethod, "fbgemm", 2e-2),
                                                   (W8A8LinearMethod, "reference_w8a8", 2e-2)])
def test_int8_linear_close_to_fp32(method, kernel, bound):
    """A ColumnParallelLinear on each int8 method and kernel stays within `bound` relative of the
    fp32 linear on the same weight, bias included (weight-only int8 at half the w8a8 bound, on
    activations without outliers); the float weight is freed after quantizing."""
    if kernel == "fbgemm" and FbgemmKernel().unavailable(torch.device("cpu")) is not None:
        pytest.skip("fbgemm needs x86")
    layer = ColumnParallelLinear(576, 960, bias=True, linear_method=method(kernel=kernel))
    w, b = _weight((960, 576)), torch.randn(960)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.data.copy_(b)
    layer.linear_method.process_layers([layer])
    assert layer.weight is None
    x = _input(9, 576)
    assert _rel(layer(x), F.linear(x, w, b)) < bound


def _full_and_sharded(cls, tp_size, make, load):
    """The layer at tp=1 and its `tp_size` rank shards, loaded from the same full tensors, int8."""
    layers = [make(cls, TPGroup(), Int8LinearMethod(kernel="reference"))]
    layers += [make(cls, TPGroup(r, tp_size), Int8LinearMethod(kernel="reference")) for r in range(tp_size)]
    for layer in layers:
        load(layer)
        layer.linear_method.process_layers([layer])
    return layers[0], layers[1:]


@pytest.mark.parametrize("cls", [ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear])
def test_column_shards_quantize_like_the_full_layer(cls):
    """Column-parallel layers (plain, merged gate_up, GQA qkv) at tp=2: each rank quantizes its own
    output rows after loading; per-row scales do not depend on the split, so the ranks' outputs,
    concatenated in the layer's order, equal the tp=1 int8 layer's exactly."""
    hidden, inter, head_dim, heads, kv_heads = 64, 96, 16, 4, 2
    full_w = {"q": _weight((heads * head_dim, hidden), 1), "k": _weight((kv_heads * head_dim, hidden), 2),
              "v": _weight((kv_heads * head_dim, hidden), 3), 0: _weight((inter, hidden), 4),
              1: _weight((inter, hidden), 5), None: _weight((inter, hidden), 6)}

    def make(cls, tp, method):
        if cls is QKVParallelLinear:
            return cls(hidden, head_dim, heads, kv_heads, tp=tp, linear_method=method)
        if cls is MergedColumnParallelLinear:
            return cls(hidden, [inter, inter], tp=tp, linear_method=method)
        return cls(hidden, inter, tp=tp, linear_method=method)

    shard_ids = {QKVParallelLinear: ["q", "k", "v"], MergedColumnParallelLinear: [0, 1]}.get(cls, [None])

    def load(layer):
        for sid in shard_ids:
            args = () if sid is None else (sid,)
            layer.weight.weight_loader(layer.weight, full_w[sid], *args)

    full, shards = _full_and_sharded(cls, 2, make, load)
    x = _input(5, hidden)
    outs = [s(x) for s in shards]
    if cls is ColumnParallelLinear:
        torch.testing.assert_close(torch.cat(outs, dim=1), full(x), rtol=0, atol=1e-6)
        return
    sizes = [[heads * head_dim // 2, kv_heads * head_dim // 2, kv_heads * head_dim // 2]
             if cls is QKVParallelLinear else [inter // 2, inter // 2]][0]
    pieces = [o.split(sizes, dim=1) for o in outs]  # per rank: its slice of each sub-output
    want = torch.cat([torch.cat([p[i] for p in pieces], dim=1) for i in range(len(sizes))], dim=1)
    torch.testing.assert_close(want, full(x), rtol=0, atol=1e-6)


def test_row_shards_quantize_within_the_int8_bound():
    """RowParallelLinear at tp=2: each rank quantizes its own input columns (scales over its half
    of each row), so the summed partial outputs differ from the tp=1 int8 layer's, but by no more
    than int8 itself differs from fp32."""
    w = _weight((64, 96))

    def make(cls, tp, method):
        return cls(96, 64, tp=tp, linear_method=method)

    full, shards = _full_and_sharded(RowParallelLinear, 2, make, lambda layer: layer.weight.weight_loader(layer.weight, w))
    x = _input(5, 96)
    summed = sum(s.linear_method.apply(s, x[:, r * 48:(r + 1) * 48], None) for r, s in enumerate(shards))
    int8_vs_fp32 = _rel(full(x), F.linear(x, w))
    assert _rel(summed, full(x)) <= 2 * int8_vs_fp32 and int8_vs_fp32 < 1e-2


def test_registry_and_resolution(caplog):
    """`auto` of a checkpoint that is not a Q4 GGUF resolves to unquantized with one log line
    saying why (tests/engine/quant/test_int4.py has the Q4 case), `none` forces it, the others are
    themselves; unknown names raise ValueError naming the choices."""
    with caplog.at_level("INFO", logger="engine.quant"):
        assert resolve_quantization("auto", "model.gguf") == "unquantized"
    assert any("auto -> unquantized" in r.getMessage() and "GGUF" in r.getMessage() for r in caplog.records)
    assert resolve_quantization("none") == "unquantized" and resolve_quantization("int8") == "int8"
    assert resolve_quantization("w8a8") == "w8a8" and resolve_quantization("int4") == "int4"
    names = ("unquantized", "int8", "w8a8", "int4")
    assert [create_linear_method(n).name for n in names] == list(names)
    for bad in (lambda: resolve_quantization("int2"), lambda: create_linear_method("fp8")):
        with pytest.raises(ValueError, match="int8"):
            bad()


def test_model_layers_get_the_method_and_the_lm_head_stays_unquantized():
    """Every decoder linear of the model delegates to the method it was built with; the LM head to
    an unquantized one; processing describes both with their layer counts."""
    from engine.models.llama import LlamaForCausalLM
    from tests.helpers import make_hf_tiny_llama, model_config_of
    hf = make_hf_tiny_llama()
    method = Int8LinearMethod(kernel="reference")
    model = LlamaForCausalLM(model_config_of(hf), linear_method=method)
    model.load_weights(hf.state_dict().items())
    groups = linear_layers(model)
    assert len(groups[method]) == 4 * hf.config.num_hidden_layers
    assert [layer for m, layers in groups.items() if m is not method for layer in layers] == [model.lm_head]
    described = process_weights_after_loading(model)
    assert "int8" in described and "(12 layers)" in described and "(1 layers)" in described


def test_w8a8_keeps_down_proj_unquantized():
    """w8a8 quantizes every decoder linear but the MLP's down_proj, which stays unquantized with its
    float weight; the description says so."""
    from engine.models.llama import LlamaForCausalLM
    from tests.helpers import make_hf_tiny_llama, model_config_of
    hf = make_hf_tiny_llama()
    model = LlamaForCausalLM(model_config_of(hf), linear_method=W8A8LinearMethod(kernel="reference_w8a8"))
    model.load_weights(hf.state_dict().items())
    described = process_weights_after_loading(model)
    for layer in model.layers:
        assert layer.mlp.down_proj.weight is not None and layer.mlp.gate_up_proj.weight is None
        assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.o_proj.weight is None
    assert "3 down_proj layers unquantized" in described
