"""Stand-ins for a CUDA stream and its events, for the same-device writer on a CPU: they record
what is asked of them in one shared log, and an event completes only when its stream says so.
`CacheWrites` adds every in-place tensor op that writes into a cache to the same log (with the
layer it writes), so a test can check what waited for what before which copy."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FakeEvent:
    def __init__(self, name: str, stream: FakeStream | None = None):
        self.name, self.stream = name, stream

    def query(self) -> bool:
        return self.stream is None or self.stream.completes


class FakeStream:
    """`completes`: whether the events it records have completed (flip it to finish a stall)."""

    def __init__(self, log: list, completes: bool = True):
        self.log, self.completes = log, completes
        self.num_recorded = 0

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.name))

    def record_event(self) -> FakeEvent:
        self.num_recorded += 1
        event = FakeEvent(f"recorded{self.num_recorded}", self)
        self.log.append(("record", event.name))
        return event


class CacheWrites(TorchDispatchMode):
    """Logs ("write", layer) for each in-place op on a view of `cache`
    (num_layers, 2, num_blocks, block_size, heads, head_dim)."""

    def __init__(self, log: list, cache: torch.Tensor):
        super().__init__()
        self.log, self.cache = log, cache
        self.layer_bytes = cache.stride(0) * cache.element_size()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (dst is not None and func.overloadpacket.__name__.endswith("_")
                and dst.untyped_storage().data_ptr() == self.cache.untyped_storage().data_ptr()):
            self.log.append(("write", (dst.data_ptr() - self.cache.data_ptr()) // self.layer_bytes))
        return out
