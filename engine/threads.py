"""Which threads of a process run torch's intra-op parallelism: the step thread alone.

torch's CPU ops parallelize over OpenMP, and an OpenMP team belongs to the thread that started
it: libgomp keeps a team for every thread that ever ran a parallel region, for as long as that
thread lives. Once a process holds more OpenMP threads than it has cores, libgomp stops spinning
between parallel regions, and every region of the step thread waits for its workers to wake.
Measured on 2 cores: one kept thread beside the step loop that had once copied a 50k-element
tensor (a KV receive does) slowed the engine by ~40%; a model built on one thread and run on
another, ~30%. So a rank builds and runs its model on one thread (cluster/rank.py), which sets
its own team size, and every other thread that touches tensors runs its ops serially.
"""
from __future__ import annotations

import torch

# torch's own default, read at import, before any thread can have changed it
DEFAULT_NUM_THREADS = torch.get_num_threads()


def _set_this_threads(n: int) -> None:
    # NOTE: the size lives per thread (OpenMP's ICV), but torch also stores it process-wide, and a
    # thread's first torch call copies that store into the thread. Make that first call before
    # setting: otherwise a size another thread stores later would overwrite this one at its first op.
    torch.get_num_threads()
    torch.set_num_threads(n)


def use_intraop_threads(num_threads: int | None) -> int:
    """On the thread that runs the model: its ops use `num_threads` threads (None: torch's default)."""
    n = num_threads or DEFAULT_NUM_THREADS
    _set_this_threads(n)
    return n


def run_serially() -> None:
    """On a thread beside the step thread that touches tensors (KV sends and receives): its ops run
    on it alone and start no OpenMP team. Threads that set their own size keep it; threads that
    have not yet run a torch op start with one too."""
    _set_this_threads(1)
