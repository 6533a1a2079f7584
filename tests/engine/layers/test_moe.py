"""The mixture-of-experts layer (engine/layers/moe.py) against a plain per-token reference written from
the routing's definition: the grouped expert compute, the routing's edge cases (ties, an expert no
token chose, every token to one expert), the load counts, and the checkpoint names it loads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core.config import ModelConfig, MoEConfig
from engine.core.expert_placement import HeldExperts, contiguous_experts
from engine.layers.expert_compute import LocalExperts
from engine.layers.moe import SparseMoeBlock, expert_param, grouped_experts, route
from engine.parallel.layers import TPGroup

HIDDEN, INTER, EXPERTS = 16, 12, 6


def reference_moe(x, router, w13, w2, top_k, renormalize):
    """Token by token: softmax over the experts, the top_k best (lower id first on a tie), each
    expert's SwiGLU output weighted by its probability (rescaled to sum to 1 if renormalize)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ router.T, dim=-1)
        chosen = sorted(range(len(probs)), key=lambda e: (-probs[e].item(), e))[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += probs[e] / total * (w2[e] @ (F.silu(gate) * up))
    return out


def _weights(seed=0, hidden=HIDDEN, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(EXPERTS, hidden, generator=g), torch.randn(EXPERTS, 2 * inter, hidden, generator=g) / 4,
            torch.randn(EXPERTS, hidden, inter, generator=g) / 4)


@pytest.mark.parametrize("method", ["loop", "grouped_mm"])
@pytest.mark.parametrize("top_k,renormalize", [(1, False), (2, True), (3, False), (EXPERTS, True)])
def test_grouped_experts_equal_the_reference(top_k, renormalize, method):
    """Grouped by expert, the weighted sum equals the per-token reference for any top_k, with each
    expert method (torch's grouped GEMM: empty groups for the experts no token chose at top_k 1)."""
    router, w13, w2 = _weights()
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, ids = route(x @ router.T, top_k, renormalize)
    got = grouped_experts(x, w13, w2, weights, ids, method=method)
    torch.testing.assert_close(got, reference_moe(x, router, w13, w2, top_k, renormalize), atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lower_expert_and_share_the_weight():
    """A router of zeros ties every expert: each token takes experts 0 and 1 at 1/2 each
    (renormalized), and the output is the reference's."""
    _, w13, w2 = _weights()
    router = torch.zeros(EXPERTS, HIDDEN)
    x = torch.randn(5, HIDDEN)
    weights, ids = route(x @ router.T, 2, True)
    assert ids.tolist() == [[0, 1]] * 5 and torch.equal(weights, torch.full((5, 2), 0.5))
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids),
                               reference_moe(x, router, w13, w2, 2, True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["loop", "grouped_mm"])
def test_every_token_to_one_expert_and_experts_no_token_chose(method):
    """A router that sends every token to expert 4 (first) and 2 (second): the four others get no
    token, their weights are never read (NaN there changes nothing), the output is the reference's."""
    router, w13, w2 = _weights()
    router = torch.zeros(EXPERTS, HIDDEN)
    router[4, 0], router[2, 0] = 10.0, 5.0
    x = torch.randn(9, HIDDEN).abs() + 0.5  # x[:, 0] > 0: the same order for every token
    weights, ids = route(x @ router.T, 2, False)
    assert ids.tolist() == [[4, 2]] * 9
    want = reference_moe(x, router, w13, w2, 2, False)
    for e in (0, 1, 3, 5):
        w13[e], w2[e] = float("nan"), float("nan")
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids, method=method), want, atol=1e-5, rtol=1e-5)


def _block(shared: int = 0, hidden: int = HIDDEN, inter: int = INTER) -> SparseMoeBlock:
    moe = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=inter, renormalize=False,
                    shared_expert_intermediate_size=shared)
    cfg = ModelConfig(vocab_size=32, hidden_size=hidden, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=8, moe=moe)
    block = SparseMoeBlock(cfg, tp=TPGroup())
    router, w13, w2 = _weights(3, hidden, inter)
    block.gate.weight.data.copy_(router)
    for e in range(EXPERTS):
        for shard, rows in enumerate(w13[e].chunk(2)):
            block.experts.weight_loader(block.experts.w13_weight, rows, e, shard)
        block.experts.weight_loader(block.experts.w2_weight, w2[e], e)
    return block


def test_block_counts_the_tokens_routed_to_each_expert():
    """`expert_counts` adds each token's top_k choices, step after step."""
    block = _block()
    x = torch.randn(10, HIDDEN)
    block(x)
    block(x[:4])
    _, ids = route(block.gate(x), 2, False)
    want = torch.bincount(ids.flatten(), minlength=EXPERTS) + torch.bincount(ids[:4].flatten(), minlength=EXPERTS)
    assert torch.equal(block.expert_counts, want) and int(block.expert_counts.sum()) == 28


def test_shared_expert_adds_its_sigmoid_gated_output():
    """Qwen2-MoE: the routed sum plus sigmoid(x . g) times the shared expert's SwiGLU output."""
    block = _block(shared=10)
    g = torch.Generator().manual_seed(4)
    gate_up, down, gate = torch.randn(20, HIDDEN, generator=g), torch.randn(HIDDEN, 10, generator=g), \
        torch.randn(1, HIDDEN, generator=g)
    block.shared_expert.gate_up_proj.weight.data.copy_(gate_up)
    block.shared_expert.down_proj.weight.data.copy_(down)
    block.shared_expert_gate.weight.data.copy_(gate)
    x = torch.randn(7, HIDDEN)
    routed = reference_moe(x, block.gate.weight, block.experts.w13_weight, block.experts.w2_weight, 2, False)
    a, b = (x @ gate_up.T).chunk(2, dim=-1)
    want = routed + torch.sigmoid(x @ gate.T) * ((F.silu(a) * b) @ down.T)
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,want", [
    ("layers.3.mlp.experts.5.gate_proj.weight", ("layers.3.mlp.experts.w13_weight", (5, 0))),
    ("layers.3.mlp.experts.5.up_proj.weight", ("layers.3.mlp.experts.w13_weight", (5, 1))),
    ("layers.3.mlp.experts.12.down_proj.weight", ("layers.3.mlp.experts.w2_weight", (12,))),
    ("layers.0.mlp.experts.7.w1.weight", ("layers.0.mlp.experts.w13_weight", (7, 0))),
    ("layers.0.mlp.experts.7.w3.weight", ("layers.0.mlp.experts.w13_weight", (7, 1))),
    ("layers.0.mlp.experts.7.w2.weight", ("layers.0.mlp.experts.w2_weight", (7,))),
    ("layers.0.mlp.shared_expert.gate_proj.weight", None),
    ("layers.0.mlp.gate.weight", None),
])
def test_expert_tensors_map_to_the_stacked_parameters(name, want):
    """Qwen's and Mixtral's per-expert names go to the layer's stacked experts; others are not experts'."""
    assert expert_param(name) == want


def test_a_mixture_refuses_the_batch_invariant_mode(tmp_path):
    """--batch-invariant with a mixture of experts: refused at start, naming the model and why."""
    from dataclasses import replace

    from engine.runner.model_runner import ModelRunner
    from tests.helpers import FAMILIES, engine_config, save_tiny
    kind, switches = FAMILIES["qwen3_moe"]
    folder = save_tiny(tmp_path / "m", kind, **switches)
    with pytest.raises(ValueError, match="--batch-invariant does not run mixture-of-experts models yet"):
        ModelRunner(replace(engine_config(model=str(folder)), batch_invariant=True))


@pytest.mark.parametrize("num_experts,num_ranks", [(8, 2), (6, 4), (5, 5)])
def test_contiguous_placement_gives_every_expert_to_one_rank(num_experts, num_ranks):
    """Expert parallelism's default placement: runs of ids, sizes differing by at most one, every
    expert on exactly one rank."""
    runs = [contiguous_experts(num_experts, r, num_ranks) for r in range(num_ranks)]
    assert sorted(e for run in runs for e in run) == list(range(num_experts))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1 and all(list(r) == sorted(r) for r in runs)


def test_expert_parallel_ranks_sum_to_the_whole():
    """Two ranks holding experts {0, 1, 2} and {3, 4, 5}: their partial sums add up to the
    grouped sum over all six (what the block's all-reduce does)."""
    router, w13, w2 = _weights(5)
    x = torch.randn(11, HIDDEN)
    weights, ids = route(x @ router.T, 2, True)
    parts = []
    for held in (contiguous_experts(EXPERTS, 0, 2), contiguous_experts(EXPERTS, 1, 2)):
        local = LocalExperts.of(HeldExperts(held, ((0, 1),) * len(held)), EXPERTS)
        parts.append(grouped_experts(x, w13[list(held)], w2[list(held)], weights, ids, local))
    torch.testing.assert_close(parts[0] + parts[1], grouped_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_the_spec_offers_every_expert_method():
    """The cluster spec's choices (engine/core/config.py) are the methods engine/layers/expert_compute.py has."""
    from engine.core.config import EXPERT_METHOD_CHOICES
    from engine.layers.expert_compute import METHOD_CHOICES
    assert EXPERT_METHOD_CHOICES == METHOD_CHOICES


def test_vllm_cpus_fused_moe_equals_the_reference():
    """vLLM-CPU's fused MoE (engine/layers/expert_compute.py `vllm_cpu`), chosen for a block: its weights
    repacked in place, the block's output equal to the per-token reference within 1e-5."""
    from engine.layers.expert_compute import vllm_cpu_moe_unavailable
    from engine.layers.moe import select_expert_methods
    block = _block(hidden=32, inter=32)  # the op's GEMM outputs (2 * 32, 32) fill its tiles
    if (why := vllm_cpu_moe_unavailable(block.experts.w13_weight, block.experts.w2_weight, None)) is not None:
        pytest.skip(f"vllm_cpu: {why}")
    x = torch.randn(9, 32)
    want = reference_moe(x, block.gate.weight, block.experts.w13_weight.clone(), block.experts.w2_weight.clone(), 2,
                         False)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    select_expert_methods(holder, "vllm_cpu")
    assert block.experts.choice.method(1) == "vllm_cpu"
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)
    # the op reads dense rows: top-k weights and ids given as views into wider tensors still work
    from engine.layers.expert_compute import vllm_cpu_experts
    weights, ids = route(block.gate(x), EXPERTS, False)
    got = vllm_cpu_experts(x, block.experts.w13_weight, block.experts.w2_weight, weights[:, :2], ids[:, :2])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed_ms,want", [
    (3.0, ["vllm_cpu"] * 4),  # faster in sum: every range, its weights repacked
    (50.0, ["grouped_mm", "grouped_mm", "loop", "loop"]),  # slower in sum: the faster of the other two per range
])
def test_auto_takes_the_packed_kernel_for_every_range_or_for_none(monkeypatch, packed_ms, want):
    """Times per range (1, 8, 32, 256 tokens): loop 4, 4, 1, 1 ms; grouped_mm 1, 1, 4, 4 ms;
    vllm_cpu `packed_ms` each. The per-range plan sums to 4 ms; vllm_cpu runs only if its sum is less."""
    from engine.layers import expert_compute
    times = {"loop": iter([4.0, 4.0, 1.0, 1.0]), "grouped_mm": iter([1.0, 1.0, 4.0, 4.0])}
    monkeypatch.setattr(expert_compute, "vllm_cpu_moe_unavailable", lambda *a: None)
    monkeypatch.setattr(expert_compute, "vllm_cpu_pack", lambda w: w)
    monkeypatch.setattr(expert_compute, "best_ms", lambda fn, args, rounds: packed_ms / 4
                        if fn is expert_compute.vllm_cpu_experts else next(times[fn.__name__.removesuffix("_experts")]))
    _, w13, w2 = _weights()
    choice = expert_compute.select_method("auto", torch.zeros(1, HIDDEN), w13, w2, 2, None)
    assert [m for _, m in choice.ranges] == want
    assert [choice.method(n) for n in (1, 8, 9, 64, 65, 10_000)] == [want[0], want[1], want[2], want[2], want[3],
                                                                      want[3]]


def test_every_rank_runs_rank_0s_choice_of_expert_method():
    """Under TP each rank times the methods, then takes what rank 0 chose (its broadcast), so one
    instance runs one method; here rank 0's is loop, whatever this rank measured."""
    from types import SimpleNamespace

    from engine.core.choices import MethodChoice
    from engine.layers.moe import select_expert_methods
    block = _block()
    rank0 = MethodChoice(((None, "loop"),), ({"loop": 1.0},))
    sent = []
    block.tp = SimpleNamespace(broadcast_object=lambda obj: sent.append(obj) or rank0, all_reduce=lambda x: x)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    select_expert_methods(holder, "auto")
    assert len(sent) == 1 and len(sent[0].ranges) == 4  # this rank's own measurement went out
    assert block.experts.choice is rank0


def test_vllm_cpus_fused_moe_in_two_threads_at_once():
    """Two step threads of one process (an in-process cluster's prefill and decode) running the
    fused MoE at once, on batches of other sizes: each gets what it gets alone. The op keeps one
    scratch buffer per process, reallocated to the size of each call; CI's 1P1D MoE run once
    served other tokens than colocated because of it."""
    import threading

    from engine.layers.expert_compute import vllm_cpu_experts, vllm_cpu_moe_unavailable, vllm_cpu_pack
    router, w13, w2 = _weights(11, hidden=64, inter=64)
    if (why := vllm_cpu_moe_unavailable(w13, w2, None)) is not None:
        pytest.skip(f"vllm_cpu: {why}")
    w13_packed, w2_packed = vllm_cpu_pack(w13), vllm_cpu_pack(w2)
    batches = []
    for n in (3, 200):
        x = torch.randn(n, 64)
        weights, ids = route(x @ router.T, 2, True)
        batches.append((x, weights, ids, vllm_cpu_experts(x, w13_packed, w2_packed, weights, ids)))
    wrong = []

    def run(x, weights, ids, want):
        for _ in range(60):
            if not torch.equal(vllm_cpu_experts(x, w13_packed, w2_packed, weights, ids), want):
                wrong.append(x.shape[0])

    threads = [threading.Thread(target=run, args=b) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("method", ["loop", "grouped_mm", "vllm_cpu"])
def test_gpt_oss_experts_equal_transformers(method):
    """gpt-oss's MLP (a router with a bias: top-k of its logits, a softmax over those; experts
    with biases and the clamped SwiGLU over interleaved gate/up rows) equals transformers'
    GptOssMLP with each expert method, on weights large enough that the clamp at 7 bites."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from engine.layers.expert_compute import vllm_cpu_moe_unavailable
    from engine.layers.moe import select_expert_methods
    hidden, inter, experts = 64, 32, 6
    torch.manual_seed(0)
    ref = GptOssMLP(GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                 num_experts_per_tok=2))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(40, hidden)
    with torch.no_grad():
        want = ref(x[None])[0][0]
        gate_up = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()  # both clamps bite
    moe = MoEConfig(num_experts=experts, top_k=2, intermediate_size=inter, renormalize=True, router_bias=True,
                    expert_bias=True, activation="swigluoai")
    block = SparseMoeBlock(ModelConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                                       num_heads=2, num_kv_heads=2, head_dim=8, moe=moe), tp=TPGroup())
    block.gate.weight.data.copy_(ref.router.weight.detach())
    block.gate.bias.data.copy_(ref.router.bias.detach())
    e = block.experts
    for param, full in ((e.w13_weight, ref.experts.gate_up_proj.transpose(1, 2)),
                        (e.w13_bias, ref.experts.gate_up_proj_bias),
                        (e.w2_weight, ref.experts.down_proj.transpose(1, 2)), (e.w2_bias, ref.experts.down_proj_bias)):
        e.load_stacked(param, full.detach())
    if method == "vllm_cpu" and (why := vllm_cpu_moe_unavailable(e.w13_weight, e.w2_weight, None)) is not None:
        pytest.skip(f"vllm_cpu: {why}")
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    select_expert_methods(holder, method)
    torch.testing.assert_close(block(x), want, atol=1e-4, rtol=1e-4)
