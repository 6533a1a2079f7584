"""The KV data plane: one two-rank channel per control connection, moving only KV payloads.

Every send and receive is posted after the control channel announced it (wire.py), and waits
under a deadline: past it the channel is aborted (its requests fail, the connection is rebuilt
on next use) and the process goes on. Which channel a pair uses the receiver decides at the
handshake (`data_channel_kind`) and names in its welcome: gloo for CPU caches; for CUDA caches
`NcclChannel` (nccl.py, operations on a stream of their own) between two GPUs, and
`HostStagedChannel` (host_staged.py: gloo through host memory) between two ranks of one GPU
whose cache is not shared, since NCCL refuses a communicator with two ranks on one device.

Channels rendezvous in a store of their own (rendezvous.py: made after the control handshake,
bound to the receiver's host, under a random prefix); `open_channel` (channel_factory.py)
takes it prefixed.
"""
from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

SENDER, RECEIVER = 0, 1
DATA_CHANNELS = ("gloo", "nccl", "host")  # what a welcome's data_channel may name


def data_channel_kind(device_type: str, same_device: bool) -> str:
    """The data channel of a pair whose KV is on `device_type` (both ends agree: CompatRecord),
    `same_device` when both ranks are on one device (equal, known shared_cache.device_key).

    Two ranks of one GPU get "host", never NCCL: NCCL takes one rank per device in a communicator
    and fails such a pair at its first operation ("Duplicate GPU detected"). vLLM and Dynamo
    would not refuse a pair that can work, so it works, slower, through host memory, and both
    ends log why; there is no option that asks for NCCL by name to refuse instead."""
    if device_type != "cuda":
        return "gloo"
    return "host" if same_device else "nccl"


class ChannelError(RuntimeError):
    """A send or receive failed or passed its deadline; the channel is aborted."""


class DataChannel(ABC):
    @abstractmethod
    def isend(self, tensor: torch.Tensor, ready: object | None = None) -> object:
        """Posts a send of `tensor` (kept alive by the caller until waited on); `ready` (a CUDA
        event) is when `tensor` has been computed. Sends complete in the order posted."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor) -> object:
        """Posts a receive into `tensor` (contiguous); receives complete in the order posted."""

    @abstractmethod
    def wait(self, handle: object, timeout_s: float) -> None:
        """Returns once the send or receive `handle` completed. ChannelError past `timeout_s`."""

    def send(self, tensor: torch.Tensor, timeout_s: float, ready: object | None = None) -> None:
        self.wait(self.isend(tensor, ready), timeout_s)

    def recv(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Fills `tensor` from the peer. ChannelError past `timeout_s`."""
        self.wait(self.irecv(tensor), timeout_s)

    def writing(self) -> contextlib.AbstractContextManager:
        """Where received payloads are scattered into the cache (CUDA: this channel's stream)."""
        return contextlib.nullcontext()

    def settle(self, timeout_s: float) -> None:
        """Returns once every write made under `writing()` so far is visible to the engine."""

    @abstractmethod
    def close(self) -> None:
        """Aborts the channel: pending operations fail at once. Safe from any thread, repeatable."""


POLL_S = 0.0005  # how often a host waits on a CUDA event polls it


def settle_event(channel: DataChannel, event, timeout_s: float) -> None:
    """Polls `event` (recorded after a channel's last write) until it completed; past `timeout_s`
    the channel is closed and ChannelError raised."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            channel.close()
            raise ChannelError("KV writes did not complete before the deadline")
        time.sleep(POLL_S)


class GlooChannel(DataChannel):
    def __init__(self, store: dist.Store, rank: int, host: str, timeout_s: float):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.pg = dist.ProcessGroupGloo(store, rank, 2, opts)
        self.peer = 1 - rank

    def isend(self, tensor: torch.Tensor, ready: object | None = None) -> object:
        return self.pg.send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor) -> object:
        return self.pg.recv([tensor], self.peer, 0)

    def wait(self, handle: object, timeout_s: float) -> None:
        try:
            handle.wait(timedelta(seconds=timeout_s))
        except Exception as exc:  # gloo raises RuntimeError on timeout and on a closed peer
            self.close()
            raise ChannelError(f"KV transfer failed: {str(exc)[:200]}") from None

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # already aborted or broken: nothing left to free
            pass
