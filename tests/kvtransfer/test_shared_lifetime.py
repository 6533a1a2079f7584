"""The same-device transport end to end (here on a CPU: POSIX shared memory for CUDA IPC, fake
streams and events where the GPU's would be): how long a prefill keeps a decode's cache mapped,
what a stalled copy keeps and fails, and what a step of interleaved parts costs in control
messages and events."""
from __future__ import annotations

import functools
import gc
import threading
import time
import weakref

import pytest
import torch

from kvtransfer import sender as sender_module
from kvtransfer.base import TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.scatter import SharedCacheWriter
from tests.kvtransfer.fake_cuda import FakeStream
from tests.kvtransfer.test_shared_cache import make_shared_receiver, shared_sender
from tests.kvtransfer.test_torch_dist import (BLOCK, COMPAT, HEADS, LAYERS, _wait_for, flat, make_cache, poll_until,
                                              send_part)

pytestmark = pytest.mark.timeout(120)
BOUND_S = 30.0


def num_mappings(rx) -> int:
    """How many times this process maps the receiver's shared-memory cache (its own is one)."""
    name = rx.shared_cache["handle"].decode().strip("/")
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def sender(**knobs):
    return create_kv_transport("torch").sender(COMPAT, "p0", same_device=True, **knobs)


def ship(tx, rx, dest, rid: str, first_slot: int = 0) -> None:
    slots = torch.arange(first_slot, first_slot + 2 * BLOCK)
    rx.expect(rid, slots, 1)
    send_part(tx, rid, dest, make_cache(), torch.arange(len(slots)), 0, HEADS).wait(BOUND_S)


def test_a_dead_receivers_cache_is_released_when_its_connection_closes():
    """The receiver goes away (its control connection reaches EOF) while the sender's connection
    is idle: the sender unmaps its cache and leaves the pool within a bound, with no further
    transfer to that address (before: it kept the mapping until 64 newer peers pushed it out)."""
    rx, dst, dest = make_shared_receiver()
    tx = shared_sender()
    ship(tx, rx, dest, "r")
    assert num_mappings(rx) == 2 and tx.num_groups == 1
    rx.close()  # as a decode process's end closes its sockets
    assert _wait_for(lambda: num_mappings(rx) == 1 and tx.num_groups == 0, BOUND_S)
    stats = tx.stats
    assert stats["caches_released"] == stats["groups_closed_by_peer"] == 1 and "groups_failed" not in stats
    tx.close()


def test_a_restarted_receiver_at_the_same_address_ends_the_connection_holding_its_old_cache():
    """A connection that still holds the cache of the decode process at an address (out of the
    pool, waiting for an ack that will never come) ends as soon as a welcome from that address
    offers the cache of another process: its part fails naming the restart, long before its
    deadline, and only the new connection's mapping remains."""
    rx, _, dest = make_shared_receiver()
    other, _, other_dest = make_shared_receiver()
    tx = sender(max_groups=1)
    ship(tx, rx, dest, "a")
    entered, leave = threading.Event(), threading.Event()
    on_done = rx.on_done

    def ack_of_b_never_comes(session, msg, part):
        if msg["request_id"] == "b":
            entered.set()
            leave.wait(BOUND_S)
        return on_done(session, msg, part)

    rx.on_done = ack_of_b_never_comes
    rx.expect("b", torch.arange(2 * BLOCK, 4 * BLOCK), 1)
    b = send_part(tx, "b", dest, make_cache(), torch.arange(2 * BLOCK), 0, HEADS)
    assert entered.wait(BOUND_S)
    tx.begin("x", other_dest, 0, HEADS, 1)  # pushes the connection waiting for b's ack out of the pool
    rx.shared_cache["pid"] += 1  # what a restarted decode process at the same address would offer
    start = time.monotonic()
    ship(tx, rx, dest, "c", first_slot=4 * BLOCK)
    with pytest.raises(TransferError, match="restarted"):
        b.wait(BOUND_S)
    assert time.monotonic() - start < tx.timeout_s
    assert _wait_for(lambda: num_mappings(rx) == 2, BOUND_S)  # the receiver's own and the new connection's
    assert tx.stats["caches_of_restarted_peers"] == 1
    leave.set()
    tx.close(), rx.close(), other.close()


def fake_stream_writers(monkeypatch, stream: FakeStream) -> None:
    """Every cache the sender opens is written on `stream`."""
    monkeypatch.setattr(sender_module, "SharedCacheWriter",
                        functools.partial(SharedCacheWriter, stream=stream))


def test_a_stalled_copy_poisons_the_connection_and_keeps_what_it_touches(monkeypatch):
    """Copies whose event never completes: past the deadline the part fails on both ends (the
    existing failure path), while the payloads it copied from and the mapping it copied into are
    kept (parked); once the copies complete the sender lets go of both."""
    stream = FakeStream([], completes=False)
    fake_stream_writers(monkeypatch, stream)
    rx, _, dest = make_shared_receiver(timeout_s=1.0)
    tx = sender(timeout_s=1.0)
    rx.expect("r", torch.arange(2 * BLOCK), 1)
    t = tx.begin("r", dest, 0, HEADS, 2 * BLOCK)
    src, refs = make_cache(), []
    for layer in range(LAYERS):
        kv = flat(src, layer)[:, :2 * BLOCK].clone()
        refs.append(weakref.ref(kv))
        t.send_layer(layer, kv)
        del kv
    t.finish(b"\x07")
    with pytest.raises(TransferError, match="did not complete"):
        t.wait(BOUND_S)
    _, failed = poll_until(rx, timeout=BOUND_S)
    assert [rid for rid, _ in failed] == ["r"]
    assert _wait_for(lambda: tx.stats["caches_parked_now"] == 1, BOUND_S)
    gc.collect()
    assert all(r() is not None for r in refs) and num_mappings(rx) == 2
    stream.completes = True
    assert tx.stats["caches_parked_now"] == 0
    gc.collect()
    assert all(r() is None for r in refs) and num_mappings(rx) == 1
    tx.close(), rx.close()


def test_a_step_of_interleaved_parts_costs_no_message_per_layer_and_one_event(monkeypatch):
    """Three parts, every layer of each queued interleaved (as a prefill step ships a batch), then
    their `done`s: the receiver hears the handshake and a begin and a done per part, nothing per
    layer, and the sender records one event for all of the step's copies; the KV lands."""
    stream = FakeStream([])
    fake_stream_writers(monkeypatch, stream)
    rx, dst, dest = make_shared_receiver()
    tx = shared_sender()
    src, num_parts = make_cache(), 3
    slots = [torch.arange(p * 2 * BLOCK, (p + 1) * 2 * BLOCK) for p in range(num_parts)]
    parts = []
    for p in range(num_parts):
        rx.expect(f"r{p}", slots[p], 1)
        parts.append(tx.begin(f"r{p}", dest, 0, HEADS, 2 * BLOCK))
    for layer in range(LAYERS):
        for p, t in enumerate(parts):
            t.send_layer(layer, flat(src, layer)[:, slots[p]].clone())
    for t in parts:
        t.finish(b"\x07")
    for t in parts:
        t.wait(BOUND_S)
    done, _ = poll_until(rx, n_events=num_parts)
    assert sorted(c.request_id for c in done) == [f"r{p}" for p in range(num_parts)]
    assert rx.stats["control_messages"] == 2 + 3 * num_parts  # hello, join; begin, trailer and done per part
    assert stream.num_recorded == 1
    for layer in range(LAYERS):
        assert torch.equal(flat(dst, layer)[:, :num_parts * 2 * BLOCK], flat(src, layer)[:, :num_parts * 2 * BLOCK])
    tx.close(), rx.close()
