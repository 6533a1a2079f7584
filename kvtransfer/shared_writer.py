"""A prefill rank's writes into a decode rank's KV cache opened on the same device
(shared_cache.open_cache): the same-device transport's one copy, its order on the GPU, and how
long what it touches must live (docs/disaggregation.md, "Same device").

    prefill compute stream   gather layer i of a part -> record ready_i   (sender.py: send_layer)
    writer's side stream     wait(export) .. wait(ready_i) -> copy into the decode's slots
    sender's thread          settle(): one event recorded after the step's copies, polled (deadline)

Order (CUDA). torch's `_new_shared_cuda` makes only the opening thread's *current* stream wait
on the decode's export event (recorded when the cache was shared); the copies run on a side
stream of their own, so it waits on that event itself before its first copy, and on each
layer's ready event before that layer's copy (no host wait, and the compute stream never waits
on a transfer). The index tensors a scatter reads are copied to the device on the side stream.

Lifetime. A payload (the gathered KV a copy reads) and the mapping (the cache a copy writes)
must outlive the copy. `write` keeps every payload until a `settle` event recorded after it has
completed. Past the deadline the writes are stalled: `settle` raises StalledWrites and keeps
them, and `release` keeps the mapping too. Unmapping under a running copy is not safe: torch's
deleter of an opened CUDA storage closes the IPC mapping first, then synchronizes only the
current stream of the thread that drops it, not this side stream. The sender parks a stalled
writer and releases it once its event completes.

On a CPU (shared memory) copies are synchronous: no stream, no events.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch

from kvtransfer.scatter import scatter_layer, whole_blocks

FEW_RUNS = 4  # up to this many runs are slice copies; more are one scatter of the layer


class StalledWrites(TimeoutError):
    """Copies into a shared cache did not complete within their deadline; what they read and
    write is kept (the connection is poisoned: its parts fail, nothing of it is reused)."""


class SharedCacheWriter:
    POLL_S = 0.0002

    def __init__(self, cache: torch.Tensor, head_offset: int, stream=None, export_event=None):
        """`cache`: the decode rank's, opened here: (num_layers, 2, num_blocks, block_size, local
        heads, head_dim), its first local head global head `head_offset`. `stream`: where the
        copies run (default: a new CUDA stream for a CUDA cache, None on a CPU). `export_event`:
        shared_cache.export_event of the cache, or None."""
        self.cache, self.head_offset = cache, head_offset
        self.device = cache.device
        self.block_size, self.num_heads = cache.shape[3], cache.shape[4]
        self.num_slots = cache.shape[2] * self.block_size
        self.stream = torch.cuda.Stream(cache.device) if stream is None and cache.is_cuda else stream
        self.pending: list[tuple] = []  # (payload, ready) copied since the last settle completed
        self.stalled = None  # the event of copies past their deadline, until it completes
        if export_event is not None:
            assert self.stream is not None, "an export event without a stream to wait on it"
            self.stream.wait_event(export_event)  # before any copy: the cache is as the decode shared it

    def target(self, runs: list[list[int]], first_slots: list[int], num_tokens: int) -> tuple:
        """Where a part's tokens go: its runs [(first token, length, first slot)] and, for many
        runs, the slots and whole block ids for `scatter_layer`. ValueError if they do not fit."""
        triples = [(start, length, slot) for (start, length), slot in zip(runs, first_slots)]
        if len(triples) != len(runs) or sum(length for _, length, _ in triples) != num_tokens or any(
                slot + length > self.num_slots for _, length, slot in triples):
            raise ValueError(f"slots {first_slots[:4]}... do not fit a cache of {self.num_slots} slots")
        if len(triples) <= FEW_RUNS:
            return triples, None, None
        slots = torch.cat([torch.arange(slot, slot + length) for _, length, slot in triples])
        blocks = whole_blocks(slots, self.block_size)
        with self._on_stream():  # the copies that read them run there
            return triples, slots.to(self.device), None if blocks is None else blocks.to(self.device)

    def write(self, layer: int, target: tuple, kv: torch.Tensor, ready, head_start: int) -> None:
        """Queues the copy of kv (2, num_tokens, heads, head_dim) into heads [head_start, ...)
        (global) of the target slots of `layer`, after `ready` (the event recorded when kv was
        gathered; None: it is ready). kv is kept until a `settle` has seen the copy complete."""
        assert self.cache is not None and self.stalled is None, "a released or stalled writer"
        triples, slots, blocks = target
        lo = head_start - self.head_offset
        assert 0 <= lo and lo + kv.shape[2] <= self.num_heads, (head_start, self.head_offset, kv.shape)
        dst = self.cache[layer]  # (2, num_blocks, block_size, heads, head_dim)
        with self._on_stream():
            if ready is not None and self.stream is not None:
                self.stream.wait_event(ready)
            if slots is not None:
                scatter_layer(dst, slots, blocks, kv, lo)
            else:
                flat = dst.view(2, self.num_slots, self.num_heads, -1)
                for start, length, slot in triples:
                    flat[:, slot:slot + length, lo:lo + kv.shape[2]].copy_(kv[:, start:start + length])
        self.pending.append((kv, ready))

    def settle(self, timeout_s: float) -> None:
        """Returns once every copy queued so far is in the cache, and lets go of their payloads:
        one event for all of them, polled on this thread; none when nothing was copied since the
        last settle. StalledWrites past `timeout_s` (the payloads are kept)."""
        if not self.pending:
            return
        if self.stream is not None:
            event = self.stream.record_event()
            deadline = time.monotonic() + timeout_s
            while not event.query():
                if time.monotonic() > deadline:
                    self.stalled = event
                    raise StalledWrites(f"KV copies into the shared cache did not complete within {timeout_s:.1f} s")
                time.sleep(self.POLL_S)
        self.pending.clear()

    def release(self, timeout_s: float) -> bool:
        """Lets go of the mapping and the payloads once every copy has completed (copies not yet
        settled get `timeout_s`). False, keeping both, while stalled copies may still run: call
        again later (this never waits on stalled copies)."""
        if self.stalled is not None:
            if not self.stalled.query():
                return False
            self.stalled = None
            self.pending.clear()
        try:
            self.settle(timeout_s)
        except StalledWrites:
            return False
        self.cache = None  # this process's reference to the opened storage: torch unmaps it
        return True

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self.stream is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()  # the sender's thread may have another current device
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack


class SharedCacheManager:
    """A sender's caches opened on its device: which connection holds which decode process's
    cache, and the writers whose copies stalled (parked: kept until their event completes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders: dict[object, tuple[tuple[str, int], int]] = {}  # connection -> (address, pid)
        self._parked: list[SharedCacheWriter] = []

    def opened(self, holder, address: tuple[str, int], pid: int) -> list:
        """`holder` opened the cache of process `pid` at `address`. Returns the other holders of a
        cache of that address from another process: a restarted decode rank's old one."""
        with self._lock:
            stale = [h for h, (a, p) in self._holders.items() if h is not holder and a == address and p != pid]
            self._holders[holder] = (address, pid)
        return stale

    def closed(self, holder, writer: SharedCacheWriter, timeout_s: float) -> bool:
        """`holder` ended: True once its writer let go of the cache (copies complete); False when
        they stalled and the writer is parked."""
        with self._lock:
            self._holders.pop(holder, None)
        if writer.release(timeout_s):
            return True
        with self._lock:
            self._parked.append(writer)
        return False

    def reap(self) -> int:
        """Releases the parked writers whose copies have completed (never waits); how many remain."""
        with self._lock:
            self._parked = [w for w in self._parked if not w.release(0.0)]
            return len(self._parked)
