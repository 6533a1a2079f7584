"""How many KV blocks a CUDA rank takes: this process's share of its device, never more than what
the device has free, from what the device reports (engine/runner/device_memory.py).

    share    = gpu_memory_utilization x total - used by this process
    used     = CUDA context + other non-torch memory + peak reserved + CUDA graphs
    headroom = free after profiling - (peak - reserved now) - CUDA graphs - margin
    KV       = min(share, headroom), in whole blocks

- CUDA context: one torch process's, probed (DeviceMemory.context); other non-torch memory: what
  the device lost beyond torch's reserved memory since the runner started (cuBLAS, kernels loaded
  on first use, NCCL), so another process's memory is never counted as this one's.
- Peak reserved: the weights plus the larger activation peak of two profiled steps, each over a
  scratch pool of a few blocks: the largest prefill step (max_num_batched_tokens tokens at the end
  of a max_model_len context) and the largest decode step: max_num_seqs sequences, one token each,
  whose contexts together are at most what the pool could ever hold (`decode_profile_context`: the
  torch backend gathers every row's whole context, so its activations grow with the rows' total
  context, which no step exceeds the pool's; at max_model_len x max_num_seqs, Llama-3.1-8B's 131,072
  context x 256 rows would gather 128 GiB of one layer's keys and values). A colocated step that
  mixes both is not profiled as such. A profile that still runs out of device memory is refused in
  one line naming the knobs.
- NCCL communicators, cuBLAS workspaces and kernels load during the profiled steps (their first
  collective and matmul): what they take outside torch is in "other non-torch", what they take
  through torch's allocator in the peak.
- CUDA graphs (engine/runner/cuda_graphs.py) are captured after the pool (they bake in its address), so
  their memory is reserved here as an estimate: the activation peak of an eager step of the
  largest pair captured, plus the logits every graph keeps; the runner logs what capture took.
- Headroom: the activations and graphs still to come must fit in what is free now, less a margin
  for what loads after the profile (kernels of the first sampling, allocator rounding). Two
  processes on one GPU: each counts only itself in its share, and the free memory holds the other.

A budget that cannot hold one request at max_model_len is refused in one line, with the numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.core.block_manager import first_read_block
from engine.core.config import ModelConfig
from engine.runner.device_memory import DeviceMemory, MemorySnapshot

logger = logging.getLogger(__name__)
GiB = 1 << 30
FREE_MARGIN = 512 << 20  # bytes of free memory never budgeted (see the module docstring)


@dataclass(frozen=True)
class MemoryBudget:
    """One rank's readings and what they leave for KV, in bytes."""
    device: str
    total: int
    utilization: float  # gpu_memory_utilization
    context: int  # the CUDA context (probed)
    non_torch: int  # other memory this process took outside torch since the runner started
    weights: int  # reserved before profiling: weights and buffers
    prefill_peak: int  # peak reserved of the prefill profile
    decode_peak: int  # peak reserved of the decode profile
    graphs: int  # reserved for CUDA graphs (0: none captured)
    reserved_after: int  # reserved after profiling, cache emptied
    free: int  # free on the device after profiling
    block_bytes: int
    prefill_tokens: int  # the profiled shapes, for the messages
    decode_seqs: int
    context_len: int  # max_model_len
    margin: int = FREE_MARGIN
    decode_context: int = 0  # each profiled decode row's context (decode_profile_context; 0: context_len)

    @property
    def peak(self) -> int:
        return max(self.prefill_peak, self.decode_peak)

    @property
    def activations(self) -> int:
        return self.peak - self.weights

    @property
    def used(self) -> int:
        """This process's memory, KV aside, at its most."""
        return self.context + self.non_torch + self.peak + self.graphs

    @property
    def share(self) -> int:
        """What gpu_memory_utilization leaves for KV once this process's own memory is counted."""
        return int(self.utilization * self.total) - self.used

    @property
    def headroom(self) -> int:
        """What the device's free memory leaves for KV once the activations and graphs to come fit."""
        return self.free - (self.peak - self.reserved_after) - self.graphs - self.margin

    @property
    def others(self) -> int:
        """Memory other processes hold on the device (what is neither free nor this process's)."""
        return max(0, self.total - self.free - self.context - self.non_torch - self.reserved_after)

    @property
    def kv_bytes(self) -> int:
        return max(0, min(self.share, self.headroom))

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    def describe(self) -> str:
        """The breakdown, one line (logged at start, and the refusal's middle)."""
        g = _gib
        return (f"{self.device}: {g(self.total)} GiB total, gpu_memory_utilization {self.utilization:.2f} = "
                f"{g(self.utilization * self.total)} GiB; used by this process {g(self.used)} GiB (weights "
                f"{g(self.weights)}, activations {g(self.activations)} [prefill {g(self.prefill_peak - self.weights)} "
                f"at {self.prefill_tokens} tokens, decode {g(self.decode_peak - self.weights)} at {self.decode_seqs} x "
                f"{self.decode_context or self.context_len}], CUDA context {g(self.context)}, other non-torch {g(self.non_torch)}, CUDA graphs "
                f"{g(self.graphs)}); free {g(self.free)} GiB (other processes hold {g(self.others)}); KV = min(share "
                f"left {g(self.share)}, free less the peak to come {g(self.peak - self.reserved_after)}, graphs and "
                f"{g(self.margin)} margin: {g(self.headroom)}) = {g(self.kv_bytes)} GiB = {self.num_blocks} blocks of "
                f"{self.block_bytes / 2**20:.2f} MiB")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def measure_budget(runner, block_bytes: int) -> MemoryBudget:
    """Profiles `runner` (weights loaded, no KV pool yet) and reads its device: the budget.

    Args:
        runner: a ModelRunner (or a stand-in) with `device_memory`, `memory_at_start`, `config`,
            `configured_max_model_len`, `block_size`, `dtype`, `model_config`, `graph_sizes()`,
            `graph_gather_bytes(batch, blocks)` and `profile_step(num_seqs, num_tokens, context_len)`.
        block_bytes: one KV block's bytes (engine/core/kv_cache.py kv_block_bytes).
    """
    mem: DeviceMemory = runner.device_memory
    start: MemorySnapshot = runner.memory_at_start
    sched, length = runner.config.scheduler, runner.configured_max_model_len
    context = mem.context()  # first: the probe's child is gone before free memory is read below
    prefill_tokens = min(sched.max_num_batched_tokens, length)
    decode_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    mem.empty_cache()
    weights = mem.reserved()
    # the most the pool could be: the share once context and weights are counted, or what is free
    pool_bound = min(int(runner.config.cache.gpu_memory_utilization * mem.total()) - context - weights,
                     mem.free() - FREE_MARGIN)
    decode_context = decode_profile_context(pool_bound, block_bytes, runner.block_size, decode_seqs, length)
    prefill_peak = _profiled_peak(mem, runner, 1, prefill_tokens, length, sched)
    decode_peak = _profiled_peak(mem, runner, decode_seqs, 1, decode_context, sched)
    graphs = _graphs_estimate(mem, runner)
    reserved_after, free = mem.reserved(), mem.free()
    # the device's used memory grew by (start.free - free); torch's part of it is the reserved growth.
    # Negative when another process freed memory meanwhile: then nothing is seen, and nothing counted
    non_torch = max(0, (start.free - free) - (reserved_after - start.reserved))
    return MemoryBudget(str(runner.device), mem.total(), runner.config.cache.gpu_memory_utilization, context,
                        non_torch, weights, prefill_peak, decode_peak, graphs, reserved_after, free, block_bytes,
                        prefill_tokens, decode_seqs, length, decode_context=decode_context)


def decode_profile_context(pool_bound: int, block_bytes: int, block_size: int, num_seqs: int, length: int) -> int:
    """Each row's context in the profiled decode step: `length` (max_model_len), or less where
    `num_seqs` rows of it hold more tokens than a pool of `pool_bound` bytes ever could: that pool's
    tokens split over the rows, in whole blocks, at least one block."""
    pool_tokens = max(0, pool_bound) // block_bytes * block_size
    per_row = pool_tokens // num_seqs // block_size * block_size
    return min(length, max(block_size, per_row))


def _profiled_peak(mem: DeviceMemory, runner, num_seqs: int, num_tokens: int, context_len: int, sched=None) -> int:
    """Peak reserved memory of one profiled step (the allocator's cache emptied after it); a step
    that runs out of device memory is refused in one line naming the knobs that shape it."""
    mem.reset_peak()
    try:
        runner.profile_step(num_seqs, num_tokens, context_len)
    except torch.OutOfMemoryError as exc:
        mem.empty_cache()
        what = "decode" if num_tokens == 1 else "prefill"
        knobs = (f"max_num_seqs ({sched.max_num_seqs})" if what == "decode" else
                 f"max_num_batched_tokens ({sched.max_num_batched_tokens})") if sched is not None else "the step's shape"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"KV budget: profiling a {what} step of {num_seqs} x {num_tokens} tokens at context "
                         f"{context_len} ran out of device memory ({first}); lower max_model_len "
                         f"({runner.configured_max_model_len}) or {knobs}, or lower gpu_memory_utilization "
                         f"({runner.config.cache.gpu_memory_utilization:.2f}) if other processes share the device"
                         ) from None
    peak = mem.peak()
    mem.empty_cache()
    return peak


def _graphs_estimate(mem: DeviceMemory, runner) -> int:
    """Bytes the decode CUDA graphs will hold (0 when none are captured): the captures share one
    memory pool, as large as the activations of the largest pair's step (profiled here, eagerly),
    and each graph keeps its logits, (batch, vocab) in the model's dtype."""
    sizes = runner.graph_sizes()
    if not sizes:
        return 0
    b, m = max(sizes, key=lambda s: (s[0] * s[1], s[0]))
    before = mem.reserved()
    activations = _profiled_peak(mem, runner, b, 1, m * runner.block_size) - before
    activations += runner.graph_gather_bytes(b, m)  # graphs over another backend's blocks gather more
    logits = sum(b for b, _ in sizes) * runner.model_config.vocab_size * runner.dtype.itemsize
    return activations + logits


def blocks_for_one_request(mc: ModelConfig, max_model_len: int, block_size: int, chunk: int) -> int:
    """Blocks one request at `max_model_len` tokens holds at most, with the null block: per KV group
    its whole context, or for a sliding group the blocks its window reads plus those a prefill chunk
    of `chunk` tokens allocates before the window frees any."""
    whole = -(-max_model_len // block_size)
    return 1 + sum(whole if window is None else whole - first_read_block(max_model_len - chunk, window, block_size)
                   for window in mc.kv_layout.windows)


def refusal(budget: MemoryBudget, num_blocks: int, needed: int, block_size: int, sched) -> str:
    """The one-line reason a rank cannot start: `num_blocks` fit (the least over the TP ranks), one
    request at max_model_len needs `needed`."""
    if budget.headroom < budget.share:
        change = (f"free memory binds: other processes on the device hold {budget.others / GiB:.2f} GiB; stop or "
                  "shrink them, or lower")
    else:
        change = f"raise gpu_memory_utilization (now {budget.utilization:.2f}), or lower"
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens fit, one request at max_model_len "
            f"{budget.context_len} needs {needed} (the null block included); {budget.describe()}; {change} "
            f"max_model_len ({budget.context_len}), max_num_seqs ({sched.max_num_seqs}: the decode profile) or "
            f"max_num_batched_tokens ({sched.max_num_batched_tokens}: the prefill profile)")


def blocks_from_device(runner, block_bytes: int) -> tuple[int, MemoryBudget]:
    """KV blocks of a rank sized from its device (the least over the TP ranks), and its budget;
    ValueError (one line, on every rank) when one request at max_model_len does not fit."""
    budget = measure_budget(runner, block_bytes)
    logger.info("KV budget on %s", budget.describe())
    n = budget.num_blocks
    if runner.tp is not None and runner.tp.size > 1:
        n = min(runner.tp.all_gather_object(n))  # every rank refuses alike: none waits on the others
    needed = blocks_for_one_request(runner.model_config, budget.context_len, runner.block_size,
                                    runner.config.scheduler.max_num_batched_tokens)
    if n < needed:
        raise ValueError(refusal(budget, n, needed, runner.block_size, runner.config.scheduler))
    return n, budget
