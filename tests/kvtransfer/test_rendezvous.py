"""The data channel's rendezvous (kvtransfer/rendezvous.py): a receiver on 127.0.0.1 listens on
127.0.0.1 only, before, during and after a channel's rendezvous, whose store is gone once both
ends of the channel are built; a rogue that sets the old, guessable rendezvous keys first (with
the store's port) and sends bytes of its own gets none of them accepted."""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kvtransfer import receiver as receiver_module
from kvtransfer import sender as sender_module
from kvtransfer.base import TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.channel import DataChannel
from tests.kvtransfer.test_torch_dist import COMPAT, HEADS, LAYERS, make_cache, make_receiver, poll_until, send_part

pytestmark = pytest.mark.timeout(60)


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the directory's own descriptor, gone once listed
        return ""


def _listening() -> dict[int, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (local address ("127.0.0.1", "0.0.0.0", "::", ...), port)."""
    mine = {int(link[8:-1]) for link in map(_link, os.listdir("/proc/self/fd")) if link.startswith("socket:[")}
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in mine:
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                out[int(f[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return out


def _port(store) -> int:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port


def test_a_receiver_on_loopback_listens_on_loopback_only_and_its_store_goes(monkeypatch):
    """Every socket a receiver given 127.0.0.1 listens on is bound to 127.0.0.1: at start, while
    a channel rendezvouses (its store), after it; the store no longer listens once both ends are built."""
    before = set(_listening())
    rx, dst, dest = make_receiver()
    seen, stores, open_channel = {}, [], receiver_module.open_channel

    def watching(store, *args, **kwargs):
        seen.update({k: v for k, v in _listening().items() if k not in before})
        stores.append(_port(store))
        return open_channel(store, *args, **kwargs)

    monkeypatch.setattr(receiver_module, "open_channel", watching)
    started = {k: v for k, v in _listening().items() if k not in before}
    rx.expect("r", torch.arange(4), 1)
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    after = {k: v for k, v in _listening().items() if k not in before}
    assert started and {a for a, _ in started.values()} == {"127.0.0.1"}, started
    assert {a for a, _ in seen.values()} == {"127.0.0.1"} and ("127.0.0.1", stores[0]) in seen.values(), seen
    assert {a for a, _ in after.values()} == {"127.0.0.1"}, after  # gloo's own listeners too
    assert all(port != stores[0] for _, port in after.values()), (after, stores)  # the store stopped listening
    assert poll_until(rx)[0][0].request_id == "r"
    tx.close(), rx.close()


class _Nowhere(DataChannel):
    """The real sender's channel, cut off by the rogue in between: its sends go nowhere."""

    def isend(self, tensor, ready=None):
        return None

    def irecv(self, tensor):
        return None

    def wait(self, handle, timeout_s):
        pass

    def close(self):
        pass


def _rogue(port: int, nbytes: int, count: int, log: list) -> None:
    """Rank 0 of channel 1 under the old names, in the store at `port`: sends `count` payloads of 1s."""
    try:
        store = dist.PrefixStore("pg/1/", dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                        timeout=timedelta(seconds=3)))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=3)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, 0, 2, opts)
        log.append("joined")
        for _ in range(count):
            pg.send([torch.ones(nbytes // 2, dtype=torch.bfloat16).view(torch.uint8)], 1, 0).wait()
            log.append("sent")
    except Exception as exc:  # no rendezvous with it: what the new protocol wants
        log.append(f"failed: {str(exc)[:80]}")


def test_a_rogue_that_sets_the_old_rendezvous_keys_first_gets_nothing_accepted(monkeypatch):
    """Between the welcome and the data channel, a rogue holding the store's port joins channel 1
    under the old key names before the sender (whose channel it cuts off) and sends bytes of its
    own: the request never completes with them and the cache stays as it was."""
    rx, dst, dest = make_receiver(timeout_s=2.0)
    rx.expect("r", torch.arange(4), 1)
    log: list = []
    nbytes = 4 * HEADS * COMPAT.head_dim * 2  # K (or V) of the part's one run, bf16

    def hijacked(store, *args, **kwargs):
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        rogue = threading.Thread(target=_rogue, args=(store.port, nbytes, 2 * LAYERS, log), daemon=True)
        rogue.start()
        rogue.join(0.5)  # it joined (old names) or is still waiting
        return _Nowhere()

    monkeypatch.setattr(sender_module, "open_channel", hijacked)
    tx = create_kv_transport("torch").sender(COMPAT, "p0", timeout_s=3.0)
    try:
        send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    except TransferError:
        pass
    done, _ = poll_until(rx, timeout=3.0)
    assert done == [] and dst.abs().sum() == 0, (log, rx.stats)
    tx.close(), rx.close()
