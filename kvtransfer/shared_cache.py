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
Writing into an opened cache, and the lifetime of the mapping: scatter.py.
"""
from __future__ import annotations

import os
import shutil

import torch

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


def export_cache(kv_cache: torch.Tensor, head_offset: int) -> dict:
    """A description of `kv_cache` (num_layers, 2, num_blocks, block_size, local heads, head_dim)
    that `open_cache` in another process of the same device_key turns into the same memory.
    ValueError naming why when it cannot be shared (the receiver logs it and offers no cache).
    On a CPU this moves the cache into shared memory, in place (views of it stay valid): call it
    before anything caches its data pointer."""
    desc = {"shape": list(kv_cache.shape), "stride": list(kv_cache.stride()), "offset": kv_cache.storage_offset(),
            "dtype": str(kv_cache.dtype).removeprefix("torch."), "head_offset": head_offset, "pid": os.getpid()}
    storage = kv_cache.untyped_storage()
    if kv_cache.is_cuda:
        try:
            (device, handle, size, offset_bytes, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
        except RuntimeError as exc:  # e.g. expandable segments, which CUDA IPC cannot export
            raise ValueError(f"the KV cache cannot be exported over CUDA IPC ({str(exc)[:200]})") from None
        return desc | {"kind": "cuda", "device": device, "handle": handle, "size": size, "offset_bytes": offset_bytes,
                       "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                       "event_sync": bool(event_sync)}
    need = storage.nbytes()
    if not storage.is_shared():
        free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
        if free < need:
            raise ValueError(f"{SHM_DIR} has {free / 2**30:.2f} GiB free, the KV cache needs {need / 2**30:.2f} GiB")
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


def export_event(desc: dict, device: torch.device) -> torch.cuda.Event | None:
    """The event the decode rank recorded on its current stream when it shared a CUDA cache
    (torch's `_share_cuda_`), opened in this process; None for a CPU cache, or when torch
    synchronized that stream instead of recording one (`event_sync` False).

    Why a writer opens it itself: torch's `_new_shared_cuda` (open_cache) makes only the current
    stream of the opening thread wait on it, and a writer copies on a stream of its own."""
    if desc.get("kind") != "cuda" or not desc.get("event_sync"):
        return None
    try:
        return torch.cuda.Event.from_ipc_handle(device, desc["event_handle"])
    except (KeyError, TypeError, RuntimeError) as exc:
        raise ValueError(f"the shared cache's export event cannot be opened: {str(exc)[:200]}") from None
