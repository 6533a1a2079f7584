"""Two ranks on one GPU whose decode cache cannot be shared never pick NCCL (which refuses two
ranks of one device: "Duplicate GPU detected"): the receiver names the host data channel (gloo
through host memory) in its welcome, both ends log why, and the KV arrives. Here on a CPU: the
CUDA device identity is faked (shared_cache.device_key, CompatRecord.device_type) and the
caches are CPU tensors, which the host channel moves as plain gloo."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvtransfer import nccl as nccl_module
from kvtransfer import receiver as receiver_module
from kvtransfer import sender as sender_module
from kvtransfer import wire
from kvtransfer.registry import create_kv_transport
from kvtransfer.channel import data_channel_kind
from kvtransfer.control import ControlClient
from kvtransfer.params import KVEndpoint
from tests.kvtransfer.test_torch_dist import BLOCK, COMPAT, make_cache, ship_to_slots

pytestmark = pytest.mark.timeout(120)
CUDA_COMPAT = dataclasses.replace(COMPAT, device_type="cuda")
GPU_0, GPU_1 = "boot/4026531840/cuda-GPU-0", "boot/4026531840/cuda-GPU-1"
NO_IPC = "the KV cache cannot be exported over CUDA IPC (expandable segments)"


@pytest.fixture
def nccl_built(monkeypatch) -> list:
    """Every NCCL channel a test's ends try to build (none is: a CPU has no NCCL)."""
    built = []

    def refuse(*args, **kwargs):
        built.append(args)
        raise RuntimeError("NCCL error: Duplicate GPU detected")

    monkeypatch.setattr(nccl_module, "NcclChannel", refuse)
    return built


def one_gpu(monkeypatch, sender_gpu: str = GPU_0, receiver_gpu: str = GPU_0) -> None:
    """Both ends' processes report these CUDA devices; the decode's cache cannot be exported."""
    monkeypatch.setattr(receiver_module, "device_key", lambda device: receiver_gpu)
    monkeypatch.setattr(sender_module, "device_key", lambda device: sender_gpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the sender's rank device: cuda:0

    def no_ipc(kv_cache, head_offset):
        raise ValueError(NO_IPC)

    monkeypatch.setattr(receiver_module, "export_cache", no_ipc)


def test_two_ranks_of_one_gpu_without_ipc_take_the_host_channel_never_nccl(monkeypatch, nccl_built, caplog):
    """Same faked GPU on both ends, IPC unavailable: the part crosses the host channel, no NCCL
    channel is attempted, and both ends log why (no cache, NCCL cannot pair one GPU's ranks)."""
    one_gpu(monkeypatch)
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(CUDA_COMPAT, cache, 0, timeout_s=5.0, share_cache=True)
    tx = create_kv_transport("torch").sender(CUDA_COMPAT, "p0", same_device=True)
    with caplog.at_level(logging.INFO, logger="kvtransfer"):
        ship_to_slots(tx, rx, KVEndpoint("d", 0, *rx.endpoint_address), cache, make_cache(),
                      torch.arange(BLOCK, 3 * BLOCK))
    assert nccl_built == [] and tx.stats["groups_created"] == 1 and "shared_connections" not in tx.stats
    sender_says = [r.message for r in caplog.records if r.name == "kvtransfer.sender" and "host memory" in r.message]
    assert len(sender_says) == 1 and NO_IPC in sender_says[0] and "NCCL" in sender_says[0]
    assert any(r.name == "kvtransfer.receiver" and NO_IPC in r.message for r in caplog.records)
    tx.close(), rx.close()


@pytest.mark.parametrize("compat,sender_gpu,kind", [(CUDA_COMPAT, GPU_0, "host"), (CUDA_COMPAT, GPU_1, "nccl"),
                                                    (CUDA_COMPAT, "", "nccl"), (COMPAT, GPU_0, "gloo")])
def test_the_welcome_names_the_channel_by_device_identity(monkeypatch, compat, sender_gpu, kind):
    """The receiver's welcome: "host" for a sender on its GPU, NCCL for one on another GPU (or
    one that cannot tell), gloo for CPU caches; only a sender on its GPU hears why no cache."""
    one_gpu(monkeypatch)
    rx = create_kv_transport("torch").receiver(compat, make_cache(fill=0.0), 0, timeout_s=5.0, share_cache=True)
    client = ControlClient(rx.endpoint_address, wire.SCHEMA)
    welcome = client.call({"kind": "hello", "sender_id": "hand", "compat": compat.to_dict(),
                           "device_key": sender_gpu}, 5)
    assert welcome["ok"] and welcome["data_channel"] == kind == data_channel_kind(compat.device_type,
                                                                                  sender_gpu == GPU_0)
    assert welcome["cache"] is None and welcome["no_cache_reason"] == (NO_IPC if sender_gpu == GPU_0 else None)
    client.close(), rx.close()
