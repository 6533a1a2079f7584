"""The KV transport of torch.distributed groups: control messages over TCP (control.py, wire.py),
payloads over a two-rank data channel per connection (channel.py: gloo for CPU caches, nccl.py
between two GPUs, host_staged.py between two ranks of one GPU; the receiver names it), or, on
one device, written straight into the decode cache (shared_cache.py, scatter.py).

    decode rank                                        prefill rank
    ControlServer (port 0) + TCPStore (port 0)  <---   ControlClient
      both prove the cluster secret (HMAC challenge; control.py), then every message is MAC'd
      hello: CompatRecord checked  ------------------>  welcome {ok, store_port, channel, data_channel, cache}
      join: both ends build channel <n> in the TCPStore under "pg/<n>/"
      begin / layer + payload / done  <--------------   one part per (request, decode rank)
"""
from __future__ import annotations

import torch

from kvtransfer.base import KVPool, KVReceiver, KVSender, KVTransport
from kvtransfer.params import CompatRecord


class TorchDistTransport(KVTransport):
    name = "torch"

    def sender(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
               max_groups: int = 64, same_device: bool = False, pool: KVPool | None = None) -> KVSender:
        from kvtransfer.sender import TorchDistSender
        return TorchDistSender(compat, sender_id, timeout_s, host, max_groups, same_device)

    def receiver(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int,
                 host: str = "127.0.0.1", timeout_s: float = 10.0, share_cache: bool = False,
                 kv_views=None, layout: str = "torch") -> KVReceiver:
        from kvtransfer.receiver import TorchDistReceiver
        return TorchDistReceiver(compat, kv_cache, head_offset, host, timeout_s, share_cache, kv_views)
