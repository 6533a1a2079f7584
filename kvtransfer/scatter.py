"""Writing KV into a paged cache: by slots from received payloads, or by the same-device writer.

Where a request's reserved slots lie in the paged cache: stretches of consecutive slots (which
a payload can be received into directly), and writing one received layer of a part into them;
and reading or writing by token a cache laid out by its attention backend (its kv_views).

The same-device writer (`SharedCacheWriter`, `SharedCacheManager`): a prefill rank's writes into a
decode rank's KV cache opened on the same device
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

On a CPU (shared memory) copies are synchronous: no stream, no events."""
from __future__ import annotations

import contextlib
import threading
import time

import torch


def scatter_layer(layer: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor | None, kv: torch.Tensor,
                  lo: int) -> None:
    """Writes kv (2, num_tokens, n_heads, head_dim) into heads [lo, lo + n_heads) of `slots` of one
    layer (2, num_blocks, block_size, local_kv_heads, head_dim); `block_ids` is
    `whole_blocks(slots, block_size)`.

    Fast path (a part with all of this rank's heads, the usual case): whole blocks are copied as
    rows of 4-byte words, 3-4x faster than per-token indexing of 2-byte elements."""
    _, num_blocks, block_size, num_heads, head_dim = layer.shape
    num_slots = num_blocks * block_size
    if lo != 0 or kv.shape[2] != num_heads:
        as_bytes(layer.view(2, num_slots, num_heads, head_dim))[:, slots, lo:lo + kv.shape[2]] = as_bytes(kv)
        return
    n_full = 0 if block_ids is None else block_ids.numel() * block_size
    if n_full:  # (2, blocks, block_size * heads * head_dim) as wide words
        dst, src = _words(layer.view(2, num_blocks, -1), kv[:, :n_full].reshape(2, block_ids.numel(), -1))
        dst.index_copy_(1, block_ids, src)
    if n_full < kv.shape[1]:  # the rest token by token: (2, slots, heads * head_dim)
        dst, rest = _words(layer.view(2, num_slots, -1), kv[:, n_full:].reshape(2, kv.shape[1] - n_full, -1))
        dst.index_copy_(1, slots[n_full:], rest)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first token, length, first slot) of each stretch of consecutive slots, in token order.

        slots [32..47, 48..63, 96..111]  ->  [(0, 32, 32), (32, 16, 96)]
    """
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, slots.numel()]
    return [(a, b - a, s) for a, b, s in zip(starts, ends, slots[starts].tolist())]


def whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if the leading full blocks' worth of slots are whole blocks in order, else None.

        slots  [b0*bs .. b0*bs+bs-1 | b1*bs .. b1*bs+bs-1 | ... | tail (< bs)]  ->  [b0, b1, ...]
    """
    n = slots.numel() // block_size
    if n == 0:
        return None
    head = slots[:n * block_size].view(n, block_size)
    starts = head[:, 0]
    if bool((starts % block_size == 0).all()) and torch.equal(head, starts[:, None] + torch.arange(
            block_size, device=slots.device)):
        return starts // block_size
    return None


def _words(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The same bytes as 4-byte words when every tensor's rows allow it (index_copy_ moves wide
    elements faster), else as they are (fp8 as bytes)."""
    def fits(t: torch.Tensor) -> bool:
        size = t.element_size()
        return size < 4 and all(n * size % 4 == 0 for n in (t.shape[-1], t.storage_offset(), *t.stride()[:-1]))
    if all(map(fits, ts)):
        return [t.view(torch.int32) for t in ts]
    return [as_bytes(t) for t in ts]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes): index_copy_, index_put_ and index_select need not
    have fp8 kernels (CPU's index_copy_ has none); any other tensor as it is."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def gather_tokens(views: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """(2, num_tokens, heads, head_dim): the K/V of `slots` read through a backend's token views
    (BaseAttentionBackend.kv_views), for caches not in the torch layout."""
    blocks, offsets = slots // block_size, slots % block_size
    return torch.stack([as_bytes(views[0])[blocks, offsets], as_bytes(views[1])[blocks, offsets]]).view(
        views[0].dtype)


def scatter_tokens(views: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, block_size: int,
                   kv: torch.Tensor, lo: int) -> None:
    """Writes kv (2, num_tokens, n_heads, head_dim) into heads [lo, lo + n_heads) of `slots` through
    a backend's token views (the inverse of gather_tokens)."""
    blocks, offsets = slots // block_size, slots % block_size
    for view, part in zip(views, kv):
        as_bytes(view)[blocks, offsets, lo:lo + kv.shape[2]] = as_bytes(part)


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
