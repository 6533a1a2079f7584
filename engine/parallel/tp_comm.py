"""Broadcasting a step from a TP driver to its followers: the step's structure as a small header
on the control group (gloo, CPU; msgpack sealed with a MAC, never pickle: engine/parallel/tp_wire.py), its
tensors as one flat buffer per dtype on the device group (NCCL on GPUs), as vLLM's
`broadcast_tensor_dict` does. Step inputs never travel through the GPU's collectives as objects,
and a follower waits for the next step on the CPU group only (an NCCL collective left waiting
while idle would hold a stream and trip NCCL's watchdog).

    driver:    split(step) -> header (step with tensor placeholders, buffer sizes) + tensors
               channel.broadcast(header) on the control group
               broadcast(one buffer per dtype) on the device group
    follower:  header -> empty buffers -> broadcast -> views -> the same step
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from engine.parallel.tp_wire import ControlChannel


class TensorSlot(NamedTuple):
    """Stands for tensor `index` of the step: its place in its dtype's buffer."""
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]


def _rebuild(x: Any, leaf) -> Any:
    """`x` with every value that `leaf` maps (to something other than None) replaced by that;
    walks dataclasses, tuples and lists (not named tuples) and dicts; other values stay."""
    if (out := leaf(x)) is not None:
        return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _rebuild(getattr(x, f.name), leaf)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return type(x)(_rebuild(v, leaf) for v in x)
    if isinstance(x, dict):
        return {k: _rebuild(v, leaf) for k, v in x.items()}
    return x


def split_tensors(obj: Any, device_type: str) -> tuple[Any, list[torch.Tensor]]:
    """`obj` with every tensor on `device_type` replaced by a slot, and those tensors in order."""
    tensors: list[torch.Tensor] = []
    offsets: dict[torch.dtype, int] = {}

    def slot(x):
        if not (isinstance(x, torch.Tensor) and x.device.type == device_type):
            return None
        offset = offsets.get(x.dtype, 0)
        offsets[x.dtype] = offset + x.numel()
        tensors.append(x)
        return TensorSlot(x.dtype, offset, tuple(x.shape))

    return _rebuild(obj, slot), tensors


def fill_tensors(skeleton: Any, buffers: dict[torch.dtype, torch.Tensor]) -> Any:
    """The inverse of `split_tensors`: every slot becomes a view of its dtype's buffer."""
    def view(x):
        if not isinstance(x, TensorSlot):
            return None
        return buffers[x.dtype][x.offset:x.offset + math.prod(x.shape)].view(x.shape)

    return _rebuild(skeleton, view)


def broadcast_step(obj: Any, rank: int, src: int, channel: ControlChannel, control_group, device_group,
                   device: torch.device) -> Any:
    """Rank `src`'s `obj` on every rank; its header travels on `channel` (over `control_group`), its
    tensors on `device` on `device_group`."""
    if rank == 0:
        skeleton, tensors = split_tensors(obj, device.type)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
        buffers = {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}
        header = (skeleton, [(dtype, b.numel()) for dtype, b in buffers.items()])
    else:
        header = None
    skeleton, sizes = channel.broadcast(header, src, control_group)
    if rank != 0:
        buffers = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes}
    for dtype, n in sizes:  # the same order on every rank: the driver's dict order, sent in the header
        if n:
            dist.broadcast(buffers[dtype], src=src, group=device_group)
    return obj if rank == 0 else fill_tensors(skeleton, buffers)
