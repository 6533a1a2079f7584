"""KV transport over torch.distributed, with no global process group.

    decode rank                                  prefill rank
    TCPStore (master, port 0) <----------------- TCPStore client
      listener thread: "conn" counter              n = add("conn", 1) - 1
      hello/<n> -> check CompatRecord  <---------  set hello/<n> = {sender_id, compat}
      set reply/<n> = {ok, compat, error} ------>  wait reply/<n>; refused -> IncompatiblePeerError
      ProcessGroupGloo(PrefixStore("pg/<n>"),      ProcessGroupGloo(PrefixStore("pg/<n>"),
                       rank 1, size 2)                              rank 0, size 2)
      reader thread per connection  <----------  frames + payloads (wire.py), acks back

Each (prefill rank, decode rank) pair gets its own two-rank group, built on first use: gloo for
CPU caches, NCCL for CUDA ones (both ends must agree: `device_type` is in the CompatRecord).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.base import KVReceiver, KVSender, KVTransport
from kvtransfer.params import CompatRecord

SENDER, RECEIVER = 0, 1


def make_pair_group(store: dist.Store, index: int, rank: int, device_type: str, host: str,
                    timeout: timedelta) -> dist.ProcessGroup:
    """The two-rank group of connection `index` on the receiver's store (blocks until both joined)."""
    prefixed = dist.PrefixStore(f"pg/{index}/", store)
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def destroy_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a pair group down; pending ops on it fail."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception:  # already broken: nothing left to free
        pass


def send(pg: dist.ProcessGroup, tensor: torch.Tensor, dst: int) -> None:
    pg.send([tensor], dst, 0).wait()


def recv(pg: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    pg.recv([tensor], src, 0).wait()


class TorchDistTransport(KVTransport):
    name = "torch"

    def sender(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
               max_groups: int = 64) -> KVSender:
        from kvtransfer.sender import TorchDistSender
        return TorchDistSender(compat, sender_id, timeout_s, host, max_groups)

    def receiver(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int,
                 host: str = "127.0.0.1", timeout_s: float = 10.0) -> KVReceiver:
        from kvtransfer.receiver import TorchDistReceiver
        return TorchDistReceiver(compat, kv_cache, head_offset, host, timeout_s)
