"""The data channels by kind: `open_channel` builds the one a welcome named (DATA_CHANNELS). The
factory of this axis, beside the interface (channel.py: DataChannel, GlooChannel), which imports
no other channel."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kvtransfer.channel import DataChannel, GlooChannel
from kvtransfer.host_staged import HostStagedChannel
from kvtransfer.nccl import NcclChannel


def open_channel(store: dist.Store, rank: int, kind: str, device: torch.device, host: str,
                 timeout_s: float) -> DataChannel:
    """This end of a channel of `kind` (DATA_CHANNELS) rendezvousing in `store` (its own,
    prefixed: rendezvous.py), for KV on `device` (blocks until both ends joined, at most
    `timeout_s`)."""
    if kind == "nccl":
        return NcclChannel(store, rank, timeout_s, device)
    if kind == "host":
        return HostStagedChannel(GlooChannel(store, rank, host, timeout_s), device)
    assert kind == "gloo", kind
    return GlooChannel(store, rank, host, timeout_s)
