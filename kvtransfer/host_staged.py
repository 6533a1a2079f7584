"""KV of a CUDA cache over gloo (TCP) through host memory: the data channel of two ranks on one
GPU whose cache is not written directly (CUDA IPC unavailable: an allocator whose segments cannot
be exported, a rank that does not write same-device caches). NCCL cannot pair them (a
communicator takes one rank per device: "Duplicate GPU detected"), and gloo moves host memory
only (ProcessGroupGloo reads the tensor's data pointer on the CPU), so each payload is staged.

Written, not verified on a GPU, and not measured: two more copies per payload (device to host on
the sender, host to device on the receiver) and the loopback TCP of gloo. On a CPU tensor it is
plain gloo (the tests run it so).

    sender:    this channel's stream waits for `ready` -> copy to host -> gloo send
    receiver:  gloo receive into a host buffer -> wait -> copy into the device tensor on this
               channel's stream (writes under `writing()` run there too); `settle` polls an
               event recorded after them
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from kvtransfer.channel import DataChannel, GlooChannel, settle_event


class _Staged(NamedTuple):
    work: object  # gloo's receive into `host`
    host: torch.Tensor
    dst: torch.Tensor  # the device tensor it is copied into once received


class HostStagedChannel(DataChannel):
    def __init__(self, gloo: GlooChannel, device: torch.device):
        """`device`: the KV cache's (the calling thread's current device may be another)."""
        self.gloo, self.device = gloo, device
        self.stream = None  # made with the first CUDA payload

    def isend(self, tensor: torch.Tensor, ready: object | None = None) -> object:
        if tensor.is_cuda:
            with self._on_stream():
                if ready is not None:
                    self.stream.wait_event(ready)
                tensor = tensor.to("cpu")  # returns once this stream has copied it: after `ready`
        return self.gloo.isend(tensor)  # gloo's work keeps the host copy alive

    def irecv(self, tensor: torch.Tensor) -> object:
        if not tensor.is_cuda:
            return self.gloo.irecv(tensor)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _Staged(self.gloo.irecv(host), host, tensor)

    def wait(self, handle: object, timeout_s: float) -> None:
        if not isinstance(handle, _Staged):
            return self.gloo.wait(handle, timeout_s)
        self.gloo.wait(handle.work, timeout_s)
        with self._on_stream():
            handle.dst.copy_(handle.host)  # from pageable memory: staged by the driver before this returns

    def writing(self) -> contextlib.AbstractContextManager:
        return self._on_stream() if self.device.type == "cuda" else contextlib.nullcontext()

    def settle(self, timeout_s: float) -> None:
        if self.stream is None:
            return
        settle_event(self, self.stream.record_event(), timeout_s)

    def close(self) -> None:
        self.gloo.close()

    def _on_stream(self) -> contextlib.ExitStack:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack
