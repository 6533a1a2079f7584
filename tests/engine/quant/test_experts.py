"""Quantized experts (engine/layers/quant_experts.py): int8 and int4 experts through each kernel against the
float reference run on their dequantized weights, the kernel choice, and a block's weights dropped."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.choices import MethodChoice
from engine.layers.expert_compute import loop_experts, sort_pairs
from engine.layers.moe import route
from engine.layers.quant_experts import FORMATS, OnBf16, candidates, q4_experts, quantize_experts
from engine.quant.q4 import quantize_q4_1
from tests.engine.layers.test_moe import EXPERTS, _block

KERNELS = [(scheme, k.name) for scheme in FORMATS for k in candidates(scheme)]
# how far each scheme's experts move the block's output from the float experts' (relative norm):
# measured int8 0.007-0.011, int4 0.11-0.14 (the weights' own relative error: 0.005 and 0.08)
ROUNDING = {"int8": 0.03, "int4": 0.3}


def _gpt_oss(block) -> None:
    """gpt-oss's expert biases and clamped SwiGLU over interleaved rows, on a test block."""
    e = block.experts
    e.activation = "swigluoai"
    e.w13_bias = torch.nn.Parameter(torch.randn(EXPERTS, 2 * e.inter), requires_grad=False)
    e.w2_bias = torch.nn.Parameter(torch.randn(EXPERTS, e.w2_weight.shape[1]), requires_grad=False)


@pytest.mark.parametrize("scheme,kernel", KERNELS)
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_quantized_experts_equal_the_reference_over_their_dequantized_weights(scheme, kernel, gpt_oss):
    """Through each kernel, the block equals the per-token reference run on the dequantized weights
    (exactly the reference's numbers in fp32, up to summation order; within bf16's rounding on bf16
    activations), with gpt-oss's biases and activation too; and stays near the float experts."""
    block = _block(hidden=32, inter=32)
    e = block.experts
    if gpt_oss:
        _gpt_oss(block)
    why = next(k for k in candidates(scheme) if k.name == kernel).unavailable(torch.device("cpu"))
    if why is not None:
        pytest.skip(f"{kernel}: {why}")
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want_float = block(x)
    quantize, dequantize, _ = FORMATS[scheme]
    deq = [torch.stack([dequantize(*quantize(w), torch.float32) for w in ws]) for ws in (e.w13_weight, e.w2_weight)]
    weights, ids = route(block.gate(x), 2, False)
    want = loop_experts(x, *deq, sort_pairs(ids, weights, EXPERTS, None), e.w13_bias, e.w2_bias, e.activation)
    e.quant = quantize_experts(scheme, e.w13_weight.data, e.w2_weight.data,
                               kernels=[k for k in candidates(scheme) if k.name == kernel])
    e.choice, e.w13_weight, e.w2_weight = MethodChoice(((None, scheme),)), None, None
    assert e.quant.kernel.name == kernel and set(e.quant.ms) == {kernel, "float"}
    with torch.no_grad():
        got = block(x)
    if kernel.endswith("_bf16"):  # activations and outputs rounded to bf16 (2^-9): measured 0.004-0.006
        assert (got - want).norm() / want.norm() < 0.02
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert 0 < (got - want_float).norm() / want_float.norm() < ROUNDING[scheme]
    assert 0 < e.quant.error < ROUNDING[scheme]


def test_q4_codes_run_as_they_are():
    """Experts given as Q4 codes (a GGUF's, engine/loading/gguf_loader.py) are their own numbers: the block
    equals the reference on those codes dequantized, and the error is not claimed (None)."""
    block = _block(hidden=32, inter=32)
    e = block.experts
    x = torch.randn(11, 32)
    codes = [tuple(torch.stack(p) for p in zip(*map(quantize_q4_1, ws))) for ws in (e.w13_weight, e.w2_weight)]
    deq = [torch.stack([FORMATS["int4"][1](*(p[i] for p in c)) for i in range(EXPERTS)]) for c in codes]
    weights, ids = route(block.gate(x), 2, False)
    want = loop_experts(x, *deq, sort_pairs(ids, weights, EXPERTS, None))
    reference = [k for k in candidates("int4") if k.name == "reference"]
    e.quant, e.w13_weight, e.w2_weight = q4_experts(*codes, torch.float32, kernels=reference), None, None
    e.choice = MethodChoice(((None, "int4"),))
    assert e.quant.error is None
    assert "int4 group-wise (32 per group) (the checkpoint's codes), kernel reference" in e.quant.describe()
    with torch.no_grad():
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_the_bf16_kernels_are_candidates_only_for_an_fp32_model():
    """OnBf16 is timed where the model is fp32 and refused by name where the activations are bf16
    already (its inner kernel is that case)."""
    kernel = OnBf16(candidates("int4")[0])
    assert kernel.name == "int4pack_bf16" and kernel.unsupported((64, 32), torch.float32) is None
    assert "already" in kernel.unsupported((64, 32), torch.bfloat16)


def test_a_block_quantizes_its_experts_and_drops_the_float_weights():
    """FusedExperts.quantize: the kernel timed fastest runs every batch, the float weights are gone,
    and an --expert-method other than auto is refused naming the scheme."""
    from engine.layers.moe import select_expert_methods
    block = _block(hidden=32, inter=32)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = block(x)
    block.experts.quantize("int4", torch.float32)
    assert block.experts.w13_weight is None and block.experts.w2_weight is None
    assert dict(block.experts.named_parameters()) == {} and block.experts.choice.method(1000) == "int4"
    assert block.experts.quant.kernel.name in {k.name for k in candidates("int4")}
    with torch.no_grad():
        assert (block(x) - want).norm() / want.norm() < ROUNDING["int4"]
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    with pytest.raises(ValueError, match="--expert-method loop runs float experts; int4 experts"):
        select_expert_methods(holder, "loop")
    select_expert_methods(holder, "auto")  # keeps the quantized kernel
    assert block.experts.choice.method(1) == "int4"


@pytest.mark.parametrize("name,kind", [("qwen2_moe", "Q4_0"), ("mixtral", "Q4_1")])
def test_a_q4_gguf_mixture_runs_the_files_codes(tmp_path, monkeypatch, caplog, name, kind):
    """A mixture's GGUF whose decoder linears are all Q4 (the stacked experts and Qwen2-MoE's
    shared expert too, as llama.cpp's quantize writes them): `auto` runs it int4 on the file's own
    codes, the experts never held in floats. With the reference kernel the logits are the file
    dequantized at load (`--quantization none`) up to summation order; with the kernel timed
    fastest, within bf16's rounding of them but where a token's routing is a near-tie (detected
    from the reference's router logits)."""
    import gguf

    from engine.layers import quant_experts
    from engine.layers.moe import moe_blocks
    from engine.runner.model_runner import ModelRunner
    from tests.engine.gguf.requantize import requantize
    from tests.helpers import all_logits, engine_config, random_prompts
    src = Path(__file__).parents[1] / "gguf" / f"{name}.gguf"
    path = str(requantize(src, tmp_path / f"{name}-{kind}.gguf", gguf.GGMLQuantizationType[kind]))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    prompt = random_prompts(1, [40], seed=3, vocab=500)[0]
    reference = ModelRunner(engine_config(model=path, quantization="none"))
    gaps = []  # per sparse layer, each position's router-logit gap between its last chosen and first unchosen expert
    for _, block in moe_blocks(reference.model):
        block.gate.register_forward_hook(lambda m, args, logits, k=block.top_k: gaps.append(
            logits.sort(-1, descending=True).values[:, k - 1:k + 1].diff(dim=-1).abs()[:, 0]))
    want = all_logits(reference, prompt, 1000)
    with caplog.at_level("INFO"):
        timed = ModelRunner(engine_config(model=path))
    blocks = [b.experts for _, b in moe_blocks(timed.model)]
    assert all(e.quant.scheme == "int4" and e.quant.error is None and e.w13_qweight is None for e in blocks)
    assert "quantization auto -> int4" in caplog.text
    assert "int4 group-wise (32 per group) (the checkpoint's codes), kernel" in caplog.text
    change = (all_logits(timed, prompt, 1000) - want).abs().amax(-1)  # per position
    # bf16 activations (if that kernel won): measured at most 0.0004 (Qwen2-MoE), 0.0033 (Mixtral)
    # at every position but near-ties: Mixtral's position 33 (a router-logit gap of 0.0005) took
    # other experts (0.19); near-ties are 2 and 4 of 40 positions
    near_tie = torch.stack(gaps).amin(0) < 0.005  # router logits
    print(f"\n[{name} {kind}] {blocks[0].quant.kernel.name}: largest change {change.max():.4f}, "
          f"elsewhere than near-ties {change[~near_tie].max():.4f}, near-ties at {near_tie.nonzero()[:, 0].tolist()}")
    assert near_tie.sum() <= 10 and change[~near_tie].max() <= 0.02
    monkeypatch.setattr(quant_experts, "candidates", lambda scheme: (quant_experts.KERNEL_PAIRS[scheme][1](),))
    torch.testing.assert_close(all_logits(ModelRunner(engine_config(model=path)), prompt, 1000), want,
                               atol=1e-4, rtol=1e-4)


def test_q4_codes_split_over_tensor_parallel_ranks_sum_to_the_whole():
    """Loaded as a GGUF's per-expert codes (gate and up rows, down columns with their groups'
    scales and minimums), two tensor-parallel ranks' partial sums add up to one rank's output."""
    from engine.layers.fused_experts import FusedExperts
    from engine.parallel.layers import TPGroup
    hidden, inter, experts = 32, 64, 3
    g = torch.Generator().manual_seed(7)
    floats = {"gate_proj": torch.randn(experts, inter, hidden, generator=g),
              "up_proj": torch.randn(experts, inter, hidden, generator=g),
              "down_proj": torch.randn(experts, hidden, inter, generator=g)}
    x = torch.randn(9, hidden, generator=g)
    weights, ids = route(torch.randn(9, experts, generator=g), 2, True)
    outs = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        e = FusedExperts(experts, hidden, inter, TPGroup(rank, size), q4_codes=True)
        for proj, w in floats.items():
            stack, shard = ("w2", None) if proj == "down_proj" else ("w13", proj == "up_proj")
            for i in range(experts):
                for kind, part in zip(("qweight", "scales", "mins"), quantize_q4_1(w[i])):
                    param = getattr(e, f"{stack}_{kind}")
                    e.weight_loader(param, part, i, *(() if shard is None else (int(shard),)))
        e.quantize("int4", torch.float32, {"reference": 1.0})  # the plain-torch kernel, no timing
        outs.append(e(x, weights, ids))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], atol=1e-4, rtol=1e-4)
