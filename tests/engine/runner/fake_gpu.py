"""A pretend CUDA device for the KV budget's tests (engine/runner/kv_budget.py): its memory as the driver
and torch's allocator would report it, with other processes on it and one process under test.

    free = total - others - context - non_torch - reserved

The process holds tensors (`allocate` / `release`); its allocator keeps what was released
cached (reserved) until `empty_cache`, and `peak` is the most it reserved since `reset_peak`.
It knows nothing of budgets: the tests compute what it should leave by hand.
"""
from __future__ import annotations

import torch

from engine.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.runner.device_memory import MemorySnapshot

GiB, MiB = 1 << 30, 1 << 20
# Llama-3-8B's shape: a KV block of 16 tokens is 32 layers x 2 x 16 x 8 heads x 128 x 2 bytes = 2 MiB
LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192)


class FakeGpu:
    """A DeviceMemory (engine/runner/device_memory.py) whose numbers the test sets."""

    def __init__(self, total: int, others: int = 0, context: int = 0):
        self.total_bytes, self.others, self.context_bytes = total, others, context
        self.non_torch = 0  # what the process took outside torch after it started
        self.in_use = self.reserved_bytes = self.peak_bytes = 0

    def total(self) -> int:
        return self.total_bytes

    def free(self) -> int:
        return self.total_bytes - self.others - self.context_bytes - self.non_torch - self.reserved_bytes

    def reserved(self) -> int:
        return self.reserved_bytes

    def peak(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.reserved_bytes

    def empty_cache(self) -> None:
        self.reserved_bytes = self.in_use

    def context(self) -> int:
        return self.context_bytes

    def allocate(self, n: int) -> None:
        """Raises torch.OutOfMemoryError, as torch's allocator does, where the device has no room."""
        if self.free() - max(0, self.in_use + n - self.reserved_bytes) < 0:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB (fake device)")
        self.in_use += n
        self.reserved_bytes = max(self.reserved_bytes, self.in_use)
        self.peak_bytes = max(self.peak_bytes, self.reserved_bytes)

    def release(self, n: int) -> None:
        self.in_use -= n


class FakeRunner:
    """What the KV budget reads of a ModelRunner, on a FakeGpu: its weights are allocated at
    construction, each profiled step holds the activations `steps` gives for its shape (num_seqs,
    num_tokens, context_len) for the step's length (KeyError for a shape the test did not expect; a
    key with context None stands for any context, which `profiled` records; `steps` may instead be a
    function of the shape), and its first step loads `first_step_non_torch` bytes outside torch
    (cuBLAS, kernels)."""

    def __init__(self, gpu: FakeGpu, weights: int, steps: dict[tuple[int, int, int], int], *,
                 utilization: float = 0.9, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 8192, first_step_non_torch: int = 0, graph_sizes=(), model_config=None):
        self.gpu = self.device_memory = gpu  # a test may read the gpu through torch.cuda instead
        self.memory_at_start = MemorySnapshot.of(gpu)  # the process starts here
        gpu.allocate(weights)
        self.steps, self.profiled, self.first_step_non_torch = steps, [], first_step_non_torch
        self.config = EngineConfig(cache=CacheConfig(gpu_memory_utilization=utilization),
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                             max_num_batched_tokens=max_num_batched_tokens))
        self.model_config, self.configured_max_model_len = model_config or LLAMA_8B, max_model_len
        self.block_size, self.dtype, self.tp, self.device = 16, torch.bfloat16, None, torch.device("cuda", 0)
        self._graph_sizes = set(graph_sizes)

    def graph_sizes(self) -> set[tuple[int, int]]:
        return self._graph_sizes

    def graph_gather_bytes(self, batch: int, blocks: int) -> int:
        return 0  # the graphs run this runner's own backend (torch): its profile holds them

    def profile_step(self, num_seqs: int, num_tokens: int, context_len: int) -> None:
        if not self.profiled:
            self.gpu.non_torch += self.first_step_non_torch
        self.profiled.append((num_seqs, num_tokens, context_len))
        if callable(self.steps):
            activations = self.steps(num_seqs, num_tokens, context_len)
        else:
            key = (num_seqs, num_tokens, context_len)
            activations = self.steps[key if key in self.steps else (num_seqs, num_tokens, None)]
        self.gpu.allocate(activations)
        self.gpu.release(activations)
