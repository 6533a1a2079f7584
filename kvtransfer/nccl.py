"""The NCCL data channel between two GPUs: written to the rules of docs/disaggregation.md
("Transports"), reviewed against PyTorch's and NCCL's documentation, never run in this project's
CI (it needs two GPUs on two ranks; a one-GPU machine cannot form such a pair either).

- A two-rank `ProcessGroupNCCL` per control connection, bootstrapped through the receiver's
  rendezvous store (rendezvous.py) after the control handshake; NCCL bootstraps at the first
  operation, so the receiver keeps that store until the channel closes. Its watchdog is told to abort the communicator on an
  error and leave the process alone (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, "CleanUpOnly"; the
  default, 3, tears the process down), and our deadlines are shorter than its timeout, so the
  deadline always acts first: we abort the group, the requests on it fail, the process lives.
- Every operation is posted from a stream of this channel's own, so the NCCL stream waits on
  that stream and never on the engine's: `work.wait()` is called only once the work has
  completed (polled with `is_completed()` under the deadline), and under this stream, so no
  compute kernel ever waits on a transfer.
- Sends first make this stream wait on the event recorded when the layer's KV copy was made
  (ordering against compute without a host sync); receives scatter into the cache on this
  stream, and `settle` polls an event recorded after the last scatter before the request is
  admitted to the engine's batch.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.channel import POLL_S, ChannelError, DataChannel, settle_event

WATCHDOG_MARGIN_S = 60.0  # the group's own timeout sits this far past our deadlines


class NcclChannel(DataChannel):
    def __init__(self, store: dist.Store, rank: int, timeout_s: float, device: torch.device):
        """`device`: the KV cache's GPU (the calling thread's current device may be another)."""
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # read when the group is made
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s + WATCHDOG_MARGIN_S)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.device(device):  # the communicator binds to the current device when it is made
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        self.peer = 1 - rank

    def isend(self, tensor: torch.Tensor, ready: object | None = None) -> object:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            return self.pg.send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor) -> object:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return self.pg.recv([tensor], self.peer, 0)

    def wait(self, handle: object, timeout_s: float) -> None:
        self._complete(handle, timeout_s)

    def writing(self):
        return torch.cuda.stream(self.stream)

    def settle(self, timeout_s: float) -> None:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record(self.stream)
        settle_event(self, event, timeout_s)

    def _complete(self, work, timeout_s: float) -> None:
        """Polls `work` on the host until it completed or the deadline passed; then orders this
        channel's stream after it (a no-op wait: it is done)."""
        deadline = time.monotonic() + timeout_s
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no completion within {timeout_s:.1f} s")
                time.sleep(POLL_S)
            with torch.cuda.stream(self.stream):
                work.wait()
        except Exception as exc:  # deadline, or NCCL reported an error for this work
            self.close()
            raise ChannelError(f"KV transfer over NCCL failed: {str(exc)[:200]}") from None

    def close(self) -> None:
        try:
            self.pg.abort()  # ncclCommAbort: pending operations end, the stream is released
        except Exception:  # already aborted
            pass
