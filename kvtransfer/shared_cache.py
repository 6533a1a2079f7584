"""A decode rank's KV cache opened by a prefill rank on the same device, for the same-device
transport (docs/disaggregation.md, "Same-device transport"): the prefill copies a request's KV
straight into the decode's blocks, with no data channel and no second copy.

    decode rank                                   prefill rank (same host, same device)
    export_cache(kv_cache) -> description  --->   open_cache(description) -> the same memory
      CUDA: the cudaMalloc segment's IPC handle     torch's UntypedStorage._new_shared_cuda
      CPU:  the cache moved into a named POSIX      torch's UntypedStorage._new_shared_filename_cpu
            shared-memory segment (/dev/shm)

The description is a plain map (msgpack): handles are bytes, nothing is unpickled. Whether two
ranks share a device is `device_key()`: the boot id, the network namespace (pods and the test
beds' hosts are network namespaces; their /dev/shm may differ) and the CUDA device's UUID.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

import torch

from kvtransfer.scatter import scatter_layer, whole_blocks

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux


def device_key(device: torch.device) -> str:
    """Equal for two processes exactly when they can open each other's cache on `device`."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: no same-device transport
        return ""
    if device.type == "cuda":
        return f"{boot}/{netns}/cuda-{torch.cuda.get_device_properties(device).uuid}"
    return f"{boot}/{netns}/cpu"


def export_cache(kv_cache: torch.Tensor, head_offset: int) -> dict | None:
    """A description of `kv_cache` (num_layers, 2, num_blocks, block_size, local heads, head_dim)
    that `open_cache` in another process of the same device_key turns into the same memory, or
    None (logged) when it cannot be shared. On a CPU this moves the cache into shared memory,
    in place (views of it stay valid): call it before anything caches its data pointer."""
    desc = {"shape": list(kv_cache.shape), "stride": list(kv_cache.stride()), "offset": kv_cache.storage_offset(),
            "dtype": str(kv_cache.dtype).removeprefix("torch."), "head_offset": head_offset, "pid": os.getpid()}
    storage = kv_cache.untyped_storage()
    if kv_cache.is_cuda:
        try:
            (device, handle, size, offset_bytes, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
        except RuntimeError as exc:  # e.g. expandable segments, which CUDA IPC cannot export
            logger.warning("same-device KV transport off: the KV cache cannot be exported over CUDA IPC (%s)", exc)
            return None
        return desc | {"kind": "cuda", "device": device, "handle": handle, "size": size, "offset_bytes": offset_bytes,
                       "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                       "event_sync": bool(event_sync)}
    need = storage.nbytes()
    if not storage.is_shared():
        free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
        if free < need:
            logger.warning("same-device KV transport off: %s has %.2f GiB free, the KV cache needs %.2f GiB",
                           SHM_DIR, free / 2**30, need / 2**30)
            return None
    manager, handle, size = storage._share_filename_cpu_()
    return desc | {"kind": "cpu", "manager": manager, "handle": handle, "size": size}


def open_cache(desc: dict, device: torch.device) -> torch.Tensor:
    """The cache `desc` describes, as a tensor of this process on `device` (the same device:
    device_key matched). ValueError when `desc` is malformed or of another kind of device."""
    try:
        kind, shape, stride, offset = desc["kind"], desc["shape"], desc["stride"], desc["offset"]
        dtype = getattr(torch, desc["dtype"])
        if kind != device.type or not isinstance(dtype, torch.dtype) or len(shape) != 6 or len(stride) != 6:
            raise ValueError(f"a {kind} cache of shape {shape} cannot be opened on {device}")
        if kind == "cuda":
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index if device.index is not None else torch.cuda.current_device(), desc["handle"], desc["size"],
                desc["offset_bytes"], desc["ref_handle"], desc["ref_offset"], desc["event_handle"], desc["event_sync"])
        else:
            storage = torch.UntypedStorage._new_shared_filename_cpu(desc["manager"], desc["handle"], desc["size"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed shared cache description: {exc!r}") from None
    except RuntimeError as exc:
        raise ValueError(f"the shared cache cannot be opened: {str(exc)[:200]}") from None
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


class SharedCacheWriter:
    """A prefill rank's writes into a decode rank's cache opened with `open_cache`.

    CUDA: each write waits (on a stream of its own) for the event recorded when its layer's KV
    was gathered, so the engine's stream never waits on a transfer; `settle` polls an event
    recorded after the writes, under a deadline, before the receiver is told they are in."""
    POLL_S = 0.0002

    def __init__(self, cache: torch.Tensor, head_offset: int):
        # cache: (num_layers, 2, num_blocks, block_size, local heads, head_dim), the decode rank's
        self.cache, self.head_offset = cache, head_offset
        self.block_size, self.num_heads = cache.shape[3], cache.shape[4]
        self.num_slots = cache.shape[2] * self.block_size
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None

    def target(self, runs: list[list[int]], first_slots: list[int], num_tokens: int) -> tuple:
        """Where a part's tokens go: its runs [(first token, length, first slot)] and, for many
        runs, the slots and whole block ids for `scatter_layer`. ValueError if they do not fit."""
        triples = [(start, length, slot) for (start, length), slot in zip(runs, first_slots)]
        if len(triples) != len(runs) or sum(length for _, length, _ in triples) != num_tokens or any(
                slot + length > self.num_slots for _, length, slot in triples):
            raise ValueError(f"slots {first_slots[:4]}... do not fit a cache of {self.num_slots} slots")
        if len(triples) <= 4:
            return triples, None, None
        slots = torch.cat([torch.arange(slot, slot + length) for _, length, slot in triples])
        blocks = whole_blocks(slots, self.block_size)
        return triples, slots.to(self.cache.device), None if blocks is None else blocks.to(self.cache.device)

    def write(self, layer: int, target: tuple, kv: torch.Tensor, ready, head_start: int) -> None:
        """kv (2, num_tokens, heads, head_dim) into heads [head_start, ...) (global) of the target slots."""
        triples, slots, blocks = target
        lo = head_start - self.head_offset
        assert 0 <= lo and lo + kv.shape[2] <= self.num_heads, (head_start, self.head_offset, kv.shape)
        dst = self.cache[layer]  # (2, num_blocks, block_size, heads, head_dim)
        with self._on_stream():
            if ready is not None:
                self.stream.wait_event(ready)
            if slots is not None:
                return scatter_layer(dst, slots, blocks, kv, lo)
            flat = dst.view(2, self.num_slots, self.num_heads, -1)
            for start, length, slot in triples:
                flat[:, slot:slot + length, lo:lo + kv.shape[2]].copy_(kv[:, start:start + length])

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()  # the sender's thread may have another current device
        stack.enter_context(torch.cuda.device(self.cache.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def settle(self, timeout_s: float) -> None:
        """Returns once every write so far is in the cache; TimeoutError past `timeout_s`."""
        if self.stream is None:
            return
        with self._on_stream():
            event = torch.cuda.Event()
            event.record(self.stream)
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV writes into the shared cache did not complete within {timeout_s:.1f} s")
            time.sleep(self.POLL_S)
