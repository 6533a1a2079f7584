"""Which threads of a process run torch's intra-op parallelism: the step thread alone.

torch's CPU ops parallelize over OpenMP, and an OpenMP team belongs to the thread that started
it: libgomp keeps a team for every thread that ever ran a parallel region, for as long as that
thread lives. Once a process holds more OpenMP threads than it has cores, libgomp stops spinning
between parallel regions, and every region of the step thread waits for its workers to wake.
Measured on 2 cores: one kept thread beside the step loop that had once copied a 50k-element
tensor (a KV receive does) slowed the engine by ~40%; a model built on one thread and run on
another, ~30%. So a rank builds and runs its model on one thread (cluster/ranks/rank.py), which sets
its own team size, and every other thread that touches tensors runs its ops serially.
"""
from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

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


def read_cpu_busy_s(cpus: frozenset[int], stat: str = "/proc/stat") -> float:
    """Seconds the `cpus` spent busy since boot (all but idle and iowait), from the kernel's counters."""
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open(stat) as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cpus:
                values = [int(t) for t in ticks]
                busy += sum(values) - values[3] - values[4]  # idle, iowait
    return busy / hz


class TeamSizer:
    """Sizes the step thread's OpenMP team to the cores other processes leave it, between steps.

    A team of n threads steps at the pace of its slowest thread: when another process takes one
    of the team's cores, every parallel region waits for the thread that shares it (measured on 2
    cores beside one busy process: 2 threads 21-22 tok/s, 1 thread 33; docs/cpu.md). Every
    `interval_s` it reads how much of its cores' time went to other processes (their busy time
    less this process's own, in cores) and resizes by one thread when they took more than the
    cores the team leaves free plus `shrink_at` of a core, or less than those less one plus
    `grow_at` (on 2 cores: a team of 2 shrinks beside more than 0.55 of a core of others' work, a
    team of 1 grows back below 0.35; a gateway and a client under load take ~0.1-0.3).

    A new size is taken once two windows in a row agree (one burst does not resize). Call
    `maybe_resize()` on the step thread only; the size is that thread's own (OpenMP's ICV)."""

    def __init__(self, max_threads: int, interval_s: float = 0.5, shrink_at: float = 0.55, grow_at: float = 0.35,
                 clock=time.monotonic, read_busy=read_cpu_busy_s, read_own=lambda: sum(os.times()[:2])):
        self.max_threads, self.num_threads = max_threads, max_threads
        self.interval_s, self.shrink_at, self.grow_at = interval_s, shrink_at, grow_at
        self.cpus = frozenset(os.sched_getaffinity(0))
        self._clock, self._read_busy, self._read_own = clock, read_busy, read_own
        self._last = (clock(), read_busy(self.cpus), read_own())
        self._pending: int | None = None
        self.num_resizes = 0

    def maybe_resize(self) -> int:
        """Returns the team size, resized (on this thread) when the host's load asked it twice in a row."""
        now = self._clock()
        t0, busy0, own0 = self._last
        if now - t0 < self.interval_s:
            return self.num_threads
        busy, own = self._read_busy(self.cpus), self._read_own()
        self._last = (now, busy, own)
        others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
        spare = len(self.cpus) - self.num_threads  # cores the team leaves to others
        want = self.num_threads
        if others > spare + self.shrink_at and self.num_threads > 1:
            want -= 1
        elif others < spare - 1 + self.grow_at and self.num_threads < self.max_threads:
            want += 1
        if want == self.num_threads or want != self._pending:
            self._pending = None if want == self.num_threads else want
            return self.num_threads
        logger.info("intra-op threads %d -> %d: other processes kept %.2f of %d cores busy", self.num_threads, want,
                    others, len(self.cpus))
        self.num_threads, self._pending = want, None
        self.num_resizes += 1
        _set_this_threads(want)
        return want
