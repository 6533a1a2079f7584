"""A TP group's rendezvous (cluster/ranks/rank.py): rank 0's store listens on the rank's own address
only, holds its port from the moment it is handed out, and a process that wins the rendezvous
cannot make a rank unpickle, or even decode, anything it sends."""
from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

from cluster.ranks.rank import join_tp_group, open_rendezvous, tp_store
from engine.parallel.tp_wire import TPAuthError

pytestmark = pytest.mark.timeout(400)  # spawned ranks: slow on a loaded 2-core box
ANY = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and :: in /proc/net/tcp{,6}


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(local address in /proc/net/tcp's hex, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (a thread of the process)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    address, port = cols[1].split(":")
                    out.append((address, int(port, 16)))
    return out


def _joining_rank(rank: int, address: str, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    tp = join_tp_group(torch.device("cpu"), rank, 2, address)
    if rank == 0:
        out.put(listening_sockets(os.getpid()))
    tp.all_gather_object(rank)  # both ranks leave after the sockets were read
    dist.destroy_process_group()


def test_the_tp_store_of_a_rank_on_127_0_0_1_listens_there_only(monkeypatch):
    """Two ranks join at 127.0.0.1 (gloo pointed at lo, as a rank's actor points it at its
    address's interface): every socket rank 0's process listens on is bound to 127.0.0.1, the
    store's port among them; none to 0.0.0.0 or ::."""
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "5" * 64)  # the ranks' processes inherit it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_joining_rank, args=(r, f"127.0.0.1:{port}", out)) for r in range(2)]
    for p in procs:
        p.start()
    listening = out.get(timeout=300)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert ("0100007F", port) in listening
    assert listening and not [a for a, _ in listening if a in ANY]


def test_the_rendezvous_holds_its_port_and_a_random_prefix():
    """From the moment rank 0 hands its rendezvous out, no other process can take its port (so none
    can serve a store of its own there), and the store it serves there listens on that address
    alone; each rendezvous has a fresh 128-bit prefix."""
    rendezvous, listener = open_rendezvous("127.0.0.1")
    with socket.socket() as rogue, pytest.raises(OSError):
        rogue.bind(("127.0.0.1", rendezvous.port))
    store = tp_store(0, 2, rendezvous, timedelta(seconds=5), listener)
    store.set("x", b"1")
    assert ("0100007F", rendezvous.port) in listening_sockets(os.getpid())
    assert not [a for a, p in listening_sockets(os.getpid()) if p == rendezvous.port and a in ANY]
    other, other_listener = open_rendezvous("127.0.0.1")
    other_listener.close()
    assert len(rendezvous.prefix) == 32 and other.prefix != rendezvous.prefix


class Payload:
    """What a rogue sends: unpickling it would run code in the rank."""

    def __reduce__(self):
        return (os.system, ("true",))


def _rank0(out, rendezvous_out) -> None:
    calls: list[str] = []

    class Unpickler(pickle.Unpickler):
        def load(self):
            calls.append("Unpickler")
            raise AssertionError("unpickled")

    pickle.Unpickler = c10d._unpickler = Unpickler
    pickle.loads = lambda *a, **k: calls.append("loads")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    rendezvous, listener = open_rendezvous("127.0.0.1")
    rendezvous_out.put(rendezvous)
    tp = join_tp_group(torch.device("cpu"), 0, 2, rendezvous, listener)
    try:
        tp.all_gather_object(([], []))  # a decode rank's KV poll
        out.put(("decoded", calls))
    except TPAuthError as exc:
        out.put((str(exc), calls))


def _rogue(rendezvous_in) -> None:
    """Joins as rank 1 knowing even the prefix (the worst case), and sends a pickle."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    rendezvous = rendezvous_in.get(timeout=280)
    dist.init_process_group("gloo", store=tp_store(1, 2, rendezvous, timedelta(seconds=280)), rank=1, world_size=2)
    try:
        dist.all_gather_object([None, None], Payload())
    except Exception:  # rank 0's answer is no pickle
        pass


def test_a_rogue_that_wins_the_rendezvous_makes_nothing_unpickled():
    """A process that joins rank 0's TP group as rank 1 and sends a pickled payload where a KV
    poll is expected: rank 0 refuses it on its MAC (TPAuthError) and nothing is unpickled."""
    ctx = mp.get_context("spawn")
    out, rendezvous = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank0, args=(out, rendezvous)), ctx.Process(target=_rogue, args=(rendezvous,))]
    for p in procs:
        p.start()
    why, calls = out.get(timeout=300)
    for p in procs:
        p.join(30)
        if p.is_alive():  # the rogue, if rank 0's answer left it waiting
            p.kill()
    assert calls == []
    assert "failed its MAC" in why or "announces" in why
