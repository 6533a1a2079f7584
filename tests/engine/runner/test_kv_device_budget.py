"""The KV budget of a GPU rank (engine/runner/kv_budget.py) from what a pretend device reports
(tests/engine/runner/fake_gpu.py): the CUDA context and other non-torch memory are this process's, the
larger of the prefill and decode profiles counts, CUDA graphs are reserved, a second process on
the device takes what is free and never more than its share, and a budget short of one request at
max_model_len is refused in one line. Every expected count is worked out by hand from the fake's
numbers: 8B-shaped blocks of 16 tokens are 2 MiB, 512 of them to the GiB; max_model_len 8192
needs 512 blocks + the null block."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.core.config import ModelConfig
from engine.core.kv_cache import kv_block_bytes
from engine.runner import device_memory
from engine.runner.device_memory import TorchDeviceMemory
from engine.runner.kv_budget import FREE_MARGIN, blocks_for_one_request, blocks_from_device
from tests.engine.runner.fake_gpu import LLAMA_8B, GiB, MiB, FakeGpu, FakeRunner

BLOCK = 2 * MiB
# the largest steps of the default scheduler at 8192: the decode's contexts are what the pool could
# hold split over its 128 rows (decode_profile_context; checked by hand where a test names it)
PREFILL, DECODE = (1, 2048, 8192), (128, 1, None)


def _runner(gpu: FakeGpu, prefill: float = 1, decode: float = 4, **knobs) -> FakeRunner:
    """16 GiB of weights, 0.25 GiB loaded outside torch by the first step; activations in GiB."""
    steps = {PREFILL: int(prefill * GiB), DECODE: int(decode * GiB), **knobs.pop("steps", {})}
    return FakeRunner(gpu, 16 * GiB, steps, first_step_non_torch=GiB // 4, **knobs)


def test_the_cuda_context_and_non_torch_memory_count_against_the_share():
    """Alone on 80 GiB at 0.9: 72 GiB less the context 0.5, non-torch 0.25, weights 16 and the
    decode peak 4 leaves 51.25 GiB = 26240 blocks (torch's peak alone would give 52 GiB)."""
    gpu = FakeGpu(80 * GiB, context=GiB // 2)
    n, budget = blocks_from_device(_runner(gpu), BLOCK)
    assert (budget.context, budget.non_torch, budget.weights) == (GiB // 2, GiB // 4, 16 * GiB)
    assert n == budget.num_blocks == 26240
    assert budget.free == 63.25 * GiB and budget.headroom == 59.25 * GiB - FREE_MARGIN


def test_the_larger_of_the_prefill_and_decode_profiles_counts():
    """The decode step (128 sequences) is profiled beside the prefill (2048 tokens at the end of
    8192); whichever peaks higher is the activations: decode 4 GiB -> 26240 blocks (the prefill's
    1 GiB alone would leave 27776); prefill 6 GiB -> 72 - 22.75 = 49.25 GiB = 25216. The decode rows'
    contexts hold what the pool could at most: 72 - 0.5 - 16 = 55.5 GiB = 28416 blocks = 454656
    tokens, 3552 per row (128 x 8192 would be more than twice the pool)."""
    runner = _runner(FakeGpu(80 * GiB, context=GiB // 2), prefill=1, decode=4)
    assert blocks_from_device(runner, BLOCK)[0] == 26240
    assert runner.profiled == [PREFILL, (128, 1, 3552)]
    assert blocks_from_device(_runner(FakeGpu(80 * GiB, context=GiB // 2), prefill=6, decode=4), BLOCK)[0] == 25216


def test_a_second_process_takes_what_is_free_not_its_whole_share(monkeypatch):
    """Another process holds 40 GiB: the share would leave 51.25 GiB as alone, but 23.25 GiB are
    free after profiling, less the 4 GiB decode peak to come and the margin: 18.75 GiB = 9600
    blocks. Read through torch.cuda as on a GPU (TorchDeviceMemory). The code before this budget
    took 0.9 x 80 - its 17 GiB peak = 55 GiB (28160 blocks) here: out of memory."""
    gpu = FakeGpu(80 * GiB, others=40 * GiB, context=GiB // 2)
    runner = _runner(gpu)
    for name, fake in {"mem_get_info": lambda d=None: (gpu.free(), gpu.total()), "memory_reserved": lambda d=None:
                       gpu.reserved(), "max_memory_reserved": lambda d=None: gpu.peak(),
                       "reset_peak_memory_stats": lambda d=None: gpu.reset_peak(), "empty_cache": gpu.empty_cache,
                       "synchronize": lambda d=None: None}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(device_memory, "probe_context_bytes", lambda device: gpu.context())
    runner.device_memory = TorchDeviceMemory(torch.device("cuda", 0))
    n, budget = blocks_from_device(runner, BLOCK)
    assert budget.share == 51.25 * GiB and budget.others == 40 * GiB
    assert n == (int(19.25 * GiB) - FREE_MARGIN) // BLOCK == 9600


def test_two_processes_on_one_gpu_each_within_its_share_and_the_free_memory():
    """Prefill 0.3 then decode 0.6 of 80 GiB: the first takes 24 - 18.75 = 5.25 GiB (2688 blocks),
    22 GiB held once its pool is there; the second counts only itself: 48 - 20.75 = 27.25 GiB (13952
    blocks), their peaks 24 + 48 within 80. A second one at 0.9 (the shares add up past 1) gets the
    free memory, not its share: 41.25 - 4 GiB less the margin = 18816 blocks."""
    first = FakeGpu(80 * GiB, context=GiB // 2)
    n1, b1 = blocks_from_device(_runner(first, decode=2, utilization=0.3, steps={DECODE: 2 * GiB}), BLOCK)
    assert n1 == 2688
    first.allocate(n1 * BLOCK)
    held = first.total() - first.free()
    assert held == 22 * GiB
    n2, b2 = blocks_from_device(_runner(FakeGpu(80 * GiB, others=held, context=GiB // 2), utilization=0.6), BLOCK)
    assert n2 == 13952 and b1.used + n1 * BLOCK + b2.used + n2 * BLOCK == 72 * GiB
    n3, _ = blocks_from_device(_runner(FakeGpu(80 * GiB, others=held, context=GiB // 2), utilization=0.9), BLOCK)
    assert n3 == (int(37.25 * GiB) - FREE_MARGIN) // BLOCK == 18816


def test_cuda_graphs_are_reserved_before_the_pool():
    """Graphs captured for (1, 4), (64, 256) and (128, 128) blocks: the largest context product,
    the larger batch on a tie, (128, 128), is profiled eagerly at 128 x 2048 tokens (1 GiB), and
    each graph keeps its logits, batch x 128256 x 2 bytes: 193 rows."""
    runner = _runner(FakeGpu(80 * GiB, context=GiB // 2), graph_sizes={(1, 4), (64, 256), (128, 128)},
                     steps={(128, 1, 2048): GiB})
    n, budget = blocks_from_device(runner, BLOCK)
    assert runner.profiled[-1] == (128, 1, 2048)
    assert budget.graphs == GiB + 193 * 128256 * 2
    assert n == (int(50.25 * GiB) - 193 * 128256 * 2) // BLOCK


def test_a_budget_short_of_one_request_at_max_model_len_is_refused_in_one_line():
    """24 GiB at 0.9: 21.6 - 20.75 GiB leaves 435 blocks, one request at 8192 needs 513; the line
    names the numbers and the knobs. Where the free memory binds, it names the other processes."""
    with pytest.raises(ValueError) as err:
        blocks_from_device(_runner(FakeGpu(24 * GiB, context=GiB // 2)), BLOCK)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("435 blocks of 16 tokens fit", "max_model_len 8192 needs 513", "24.00 GiB total",
                 "gpu_memory_utilization 0.90 = 21.60 GiB", "share left 0.85", "weights 16.00", "activations 4.00", "CUDA context 0.50",
                 "other non-torch 0.25", "CUDA graphs 0.00", "free 7.25 GiB", "raise gpu_memory_utilization (now 0.90)",
                 "max_model_len (8192)", "max_num_seqs (128", "max_num_batched_tokens (2048"):
        assert part in msg, part
    with pytest.raises(ValueError, match="384 blocks .* other processes on the device hold 58.00 GiB"):
        blocks_from_device(_runner(FakeGpu(80 * GiB, others=58 * GiB, context=GiB // 2)), BLOCK)


def test_one_request_holds_a_sliding_group_s_window_and_one_chunk():
    """Gemma 2's alternating layers (two KV groups): the full group holds all 8192 / 16 = 512
    blocks, the sliding one (window 4096) those its window reads and one chunk of 2048 tokens more:
    positions from (8192 - 2048) - 4096 + 1 on, blocks 128 to 511, 384; plus the null block."""
    mc = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=1,
                     head_dim=32, sliding_window=4096, layer_types=("sliding_attention", "full_attention") * 2)
    assert blocks_for_one_request(mc, 8192, 16, 2048) == 1 + 512 + 384
    assert blocks_for_one_request(mc, 1024, 16, 2048) == 1 + 64 + 64


# Real shapes at their real contexts (issue 50): Llama-3.1-8B (bf16, 131,072 positions) and
# DeepSeek-V3 (its latent cache: 61 layers of one 576-wide entry per token, 163,840 positions; one
# rank's share of its 671 GB of fp8 weights: TP 16 on 80 GiB devices, TP 8 on 141 GiB ones), on 80
# GiB (H100) and 141 GiB (H200) devices.
LLAMA_31_8B = replace(LLAMA_8B, max_position_embeddings=131072)
DEEPSEEK_V3 = ModelConfig(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128,
                          num_kv_heads=1, head_dim=288, max_position_embeddings=163840)
SHAPES = {"llama-3.1-8b": (LLAMA_31_8B, lambda device_gib: 16 * GiB),
          "deepseek-v3": (DEEPSEEK_V3, lambda device_gib: 671 * 10**9 // (16 if device_gib < 100 else 8))}


def _gathered(mc: ModelConfig):
    """The torch backend's decode step as the fake holds it: each row's whole context of one layer's
    keys and values gathered at once (bf16), plus 1 GiB of everything else."""
    per_token = 2 * mc.num_kv_heads * mc.head_dim * 2
    return lambda num_seqs, num_tokens, context: num_seqs * context * per_token + GiB


@pytest.mark.parametrize("device_gib", [80, 141])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_real_shapes_at_their_real_context_profile_within_the_device(shape, device_gib):
    """256 rows at the model's whole context would gather 256 x 131,072 tokens of a layer for the 8B
    (128 GiB of keys and values: more than either device); the profiled rows hold together what the pool could, so
    the profile fits the device and the pool holds one request at the real context."""
    mc, weights = SHAPES[shape][0], SHAPES[shape][1](device_gib)
    block = kv_block_bytes(mc, mc.num_kv_heads, 16, torch.bfloat16)
    length = mc.max_position_embeddings
    gpu = FakeGpu(device_gib * GiB, context=GiB // 2)
    runner = FakeRunner(gpu, weights, _gathered(mc), max_num_seqs=256, max_num_batched_tokens=8192,
                        max_model_len=length, model_config=mc)
    n, budget = blocks_from_device(runner, block)
    (rows, _, context), = [p for p in runner.profiled if p[1] == 1]
    assert rows == 256 and context < length
    assert rows * context * block // 16 <= budget.utilization * budget.total - budget.weights  # no more than a pool
    assert budget.used + n * block <= gpu.total()
    assert n >= blocks_for_one_request(mc, length, 16, 8192)


@pytest.mark.parametrize("device_gib", [80, 141])
def test_the_8b_profile_at_max_model_len_rows_would_not_fit(device_gib):
    """What the decode profile asked before: 256 rows at 131,072 tokens, 128 GiB of one layer's keys
    and values gathered at once: more than either device."""
    mc, weights = SHAPES["llama-3.1-8b"][0], SHAPES["llama-3.1-8b"][1](device_gib)
    runner = FakeRunner(FakeGpu(device_gib * GiB, context=GiB // 2), weights, _gathered(mc), model_config=mc,
                        max_model_len=131072)
    with pytest.raises(torch.OutOfMemoryError):
        runner.profile_step(256, 1, 131072)


def test_a_profile_that_runs_out_of_memory_is_refused_in_one_line():
    """A decode profile larger than the device: one line naming the step and the knobs, not torch's
    OutOfMemoryError from deep in a layer."""
    runner = _runner(FakeGpu(80 * GiB, context=GiB // 2), decode=70)
    with pytest.raises(ValueError) as err:
        blocks_from_device(runner, BLOCK)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("profiling a decode step of 128 x 1 tokens at context 3552 ran out of device memory",
                 "CUDA out of memory", "max_model_len (8192)", "max_num_seqs (128)", "gpu_memory_utilization (0.90)"):
        assert part in msg, part
