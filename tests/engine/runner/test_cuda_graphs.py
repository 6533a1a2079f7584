"""The static decode step CUDA graphs capture (engine/runner/cuda_graphs.py), run eagerly on the CPU:
padded to a captured batch size and context bucket, its logits equal the plain decode path's for
every real row, step after step; steps it cannot take (prefills, too long) are refused. The
capture itself needs a GPU (bench/gpu_check.py)."""
from __future__ import annotations

import pytest
import torch

from engine.core.request import SamplingParams
from engine.runner.cuda_graphs import DecodeGraphs, block_buckets
from tests.helpers import make_hf_tiny_llama, random_prompts, tiny_engine

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_buckets_double_up_to_the_longest():
    assert block_buckets(40) == [4, 8, 16, 32, 40] and block_buckets(3) == [3] and block_buckets(8) == [4, 8]


@pytest.mark.parametrize("num_requests,backend", [(1, "torch"), (3, "torch"), (6, "torch"), (6, "flex")])
def test_static_decode_step_equals_the_plain_one(num_requests, backend):
    """With flex as the instance's backend, its pure-decode steps replay the torch backend's static
    decode over flex's blocks (graph_backend): equal to flex's own eager steps within float32 noise."""
    engine = tiny_engine(make_hf_tiny_llama(seed=4), num_blocks=96, block_size=4, attention_backend=backend)
    runner, sched_of = engine.runner, engine.scheduler
    graphs = DecodeGraphs(runner, max_batch=8, max_blocks=64, capture=False, max_context_tokens=8 * 16 * 4)
    assert runner.backend.name == backend and graphs.backend.name == "torch"
    assert (graphs.backend is runner.backend) == (backend == "torch")
    # what the KV budget reserves beyond the main backend's eager step: flex's graphs gather K and V
    kv_row = runner.num_kv_heads * runner.model_config.head_dim * 4  # float32
    assert runner.graph_gather_bytes(8, 16) == (0 if backend == "torch" else 2 * 8 * 16 * 4 * kv_row)
    for i, p in enumerate(random_prompts(num_requests, [5, 17, 30], seed=num_requests)):
        engine.add_request(f"r{i}", p, GREEDY)
    decode_steps = refused = 0
    while engine.has_unfinished():
        sched = sched_of.schedule()
        runner.update_states(sched)
        inp = runner.prepare_inputs(sched)
        eager = runner.execute_model(inp)
        size = graphs.size_for(inp)
        if size is None:
            refused += 1
        else:
            decode_steps += 1
            b, m = size
            assert b >= inp.meta.num_seqs and m * 4 >= max(inp.meta.seq_lens_cpu) and b * m * 4 <= 8 * 16 * 4
            torch.testing.assert_close(graphs.run(inp, size), eager, rtol=1e-5, atol=1e-5 if backend == "torch" else 1e-4)
        engine.output.process(sched_of.update(sched, runner.sample(inp, eager)))
    assert decode_steps >= 30 and refused >= 1  # prefills, and contexts past the largest allowed bucket


def test_graphs_run_torch_decode_over_every_backend_that_keeps_torchs_blocks():
    """Which static decode the graphs capture: the torch backend's own; for flash_attn (and flex,
    above) a torch backend over the same blocks; none for a backend whose blocks are its own
    (vllm_cpu), which the runner logs as the reason decode runs eagerly."""
    from engine.attention.flash_backend import FlashAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.runner.cuda_graphs import graph_backend
    torch_backend = TorchAttentionBackend()
    assert graph_backend(torch_backend) is torch_backend
    flash = FlashAttentionBackend(varlen_fn=lambda *a, **k: None, kvcache_fn=lambda *a, **k: None)
    assert graph_backend(flash).name == "torch"
    own = type("OwnBlocks", (TorchAttentionBackend,), {"own_kv_layout": True, "has_static_decode": False})()
    assert graph_backend(own) is None


@pytest.mark.parametrize("what,why", [
    ({}, None),
    ({"backend": "flex"}, None), ({"backend": "flash_attn"}, None),
    ({"backend": "vllm_cpu"}, "the vllm_cpu attention backend lays out its own KV blocks"),
    ({"device": "cpu"}, "device cpu"), ({"enforce_eager": True}, "--enforce-eager"),
    ({"batch_invariant": True}, "--batch-invariant"), ({"tp": 2}, "tensor-parallel ranks"),
    ({"family": "mla"}, "latent attention"), ({"family": "moe"}, "mixture of experts"),
    ({"groups": 2}, "2 KV groups"), ({"head": True}, "a speculative head reads each step's hidden states"),
])
def test_the_graph_plan_on_a_gpu_per_backend_and_family(what, why):
    """What a CUDA runner would capture (None: graphs) or why its decode steps stay eager, for each
    backend and each model family's trait, read off a stand-in of the runner's attributes."""
    from types import SimpleNamespace

    from engine.attention.flash_backend import FlashAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.runner.model_runner import ModelRunner
    own = type("VllmCpu", (TorchAttentionBackend,), {"name": "vllm_cpu", "own_kv_layout": True,
                                                      "has_static_decode": False})
    backends = {"torch": TorchAttentionBackend, "flex": type("Flex", (TorchAttentionBackend,), {
                    "name": "flex", "has_static_decode": False}),
                "flash_attn": lambda: FlashAttentionBackend(varlen_fn=print, kvcache_fn=print), "vllm_cpu": own}
    backend = backends[what.get("backend", "torch")]()
    runner = SimpleNamespace(
        config=SimpleNamespace(enforce_eager=what.get("enforce_eager", False),
                               batch_invariant=what.get("batch_invariant", False)),
        device=torch.device(what.get("device", "cuda")), backend=backend, backends=[backend] * what.get("groups", 1),
        tp=SimpleNamespace(size=what.get("tp", 1)),
        model_config=SimpleNamespace(mla=object() if what.get("family") == "mla" else None,
                                     moe=object() if what.get("family") == "moe" else None),
        draft=SimpleNamespace(reads_target_hidden=True) if what.get("head") else None)
    got = ModelRunner._graphs_off(runner)
    assert got == why if why is None else got.startswith(why), got
