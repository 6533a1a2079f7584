"""The `nixl` KV transport (docs/disaggregation.md, "NIXL"): the decode rank reads each part from
the prefill rank's registered pool with NIXL READs over UCX, as vLLM's NixlConnector does; control
messages on the torch transport's authenticated channel (nixl_wire.py).

    decode rank                                        prefill rank
    ControlServer (port 0), NIXL agent   <---------   ControlClient, NIXL agent (pool registered)
      both prove the cluster secret, then every message is MAC'd
      hello {compat, agent metadata, pool shape}  --->  the receiver adds the agent
      begin {slots of the part's tokens} -> ready; layer i..j (written) -> NIXL READ of them
      done -> ack once every read landed (the prefill's blocks are freed then)
"""
from __future__ import annotations

import torch

from kvtransfer.base import KVPool, KVReceiver, KVSender, KVTransport
from kvtransfer.params import CompatRecord


class NixlTransport(KVTransport):
    name = "nixl"

    def sender(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
               max_groups: int = 64, same_device: bool = False, pool: KVPool | None = None) -> KVSender:
        """`same_device` is moot: the decode rank reads, whatever device it is on."""
        if pool is None:
            raise ValueError("the nixl transport's sender registers the rank's KV pool: pass `pool`")
        from kvtransfer.nixl_sender import NixlSender
        return NixlSender(compat, sender_id, pool, timeout_s, host, max_groups)

    def receiver(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int,
                 host: str = "127.0.0.1", timeout_s: float = 10.0, share_cache: bool = False,
                 kv_views=None, layout: str = "torch") -> KVReceiver:
        from kvtransfer.nixl_receiver import NixlReceiver
        return NixlReceiver(compat, kv_cache, head_offset, host, timeout_s, kv_views, layout)
