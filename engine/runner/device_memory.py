"""What a CUDA device says about its memory, behind one small interface, so that the KV budget
(engine/runner/kv_budget.py) is computed from readings alone: on a GPU from torch.cuda, in CPU tests and
dry runs from a stand-in that plays a device.

    total()      the device's memory                               torch.cuda.mem_get_info()[1]
    free()       free on the device, every process counted          torch.cuda.mem_get_info()[0]
    reserved()   what this process's torch caching allocator holds  torch.cuda.memory_reserved()
    peak()       the most it held since reset_peak()                torch.cuda.max_memory_reserved()
    context()    what a torch process's CUDA context takes, outside torch's allocator (a probe)

Why a probe for the context: the device's used memory (total - free) less this process's reserved
memory counts every other process on the device too (a second instance on a shared GPU would
count the first one's whole budget as its own), and free memory cannot be read from before this
process's own context exists (reading it makes one). So the context is measured from outside: a
child process (spawned, so it inherits this one's CUDA_VISIBLE_DEVICES) makes its CUDA context on
the same device while this one reads the device's free memory before and during: the difference
is one torch process's context. It assumes no other process allocates or frees on the device in
those few seconds (the controller starts instances on a shared GPU one at a time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.multiprocessing as mp

PROBE_TIMEOUT_S = 120.0  # a child process that imports torch and makes a CUDA context


class DeviceMemory(Protocol):
    """Memory readings of one device, in bytes (the table above)."""

    def total(self) -> int:
        """The device's memory."""

    def free(self) -> int:
        """Free on the device now, whichever process holds the rest."""

    def reserved(self) -> int:
        """What this process's torch allocator holds now (in use or cached)."""

    def peak(self) -> int:
        """The most reserved() has been since the last reset_peak()."""

    def reset_peak(self) -> None:
        """Starts a new peak() at the current reserved()."""

    def empty_cache(self) -> None:
        """Returns what torch's allocator holds unused to the device (reserved() shrinks, free() grows)."""

    def context(self) -> int:
        """A torch process's CUDA context on this device: memory this process holds outside torch's
        allocator from its start."""


@dataclass(frozen=True)
class MemorySnapshot:
    """free() and reserved() at one moment: the model runner's is taken as it starts, before the
    weights, so that what the process adds outside torch afterwards can be told apart."""
    free: int
    reserved: int

    @classmethod
    def of(cls, memory: DeviceMemory) -> MemorySnapshot:
        return cls(memory.free(), memory.reserved())


class TorchDeviceMemory:
    """DeviceMemory of a CUDA device, read through torch.cuda; the context is probed once."""

    def __init__(self, device: torch.device):
        assert device.type == "cuda" and device.index is not None, device
        self.device = device
        self._context: int | None = None

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def context(self) -> int:
        if self._context is None:
            self._context = probe_context_bytes(self.device)
        return self._context


def probe_context_bytes(device: torch.device) -> int:
    """Bytes of one torch process's CUDA context on `device`: the device's free memory before, and
    while, a spawned child holds one (see the module's docstring). RuntimeError if the child does
    not make one in PROBE_TIMEOUT_S, or if the reading is not a positive size (something else on the
    device freed memory meanwhile): a budget must not be built on it."""
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    before = torch.cuda.mem_get_info(device)[0]
    child = ctx.Process(target=_hold_context, args=(device.index, ready, done), daemon=True,
                        name="cuda-context-probe")
    child.start()
    try:
        if not ready.wait(PROBE_TIMEOUT_S):
            raise RuntimeError(f"the CUDA context probe made no context on {device} in {PROBE_TIMEOUT_S:.0f} s "
                               f"(exit code {child.exitcode})")
        during = torch.cuda.mem_get_info(device)[0]
    finally:
        done.set()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(10)
    if before - during <= 0:
        raise RuntimeError(f"the CUDA context probe read {before - during} bytes on {device} (free {before} before, "
                           f"{during} during): memory was freed on the device meanwhile; start again")
    return before - during


def _hold_context(index: int, ready, done) -> None:
    """The probe's child: makes its CUDA context on device `index` (reading its memory does) and
    holds it until the parent has read the device's free memory."""
    torch.cuda.mem_get_info(index)
    ready.set()
    done.wait(PROBE_TIMEOUT_S)
