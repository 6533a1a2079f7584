"""The same-device KV transport: a prefill rank on the decode rank's device writes a part's KV
straight into the decode cache (CUDA IPC on a GPU; here, on a CPU, POSIX shared memory). The
cache equals the reference scatter, in this process and from another one; a cancel waits for a
granted part's `done`; a grant never ended drops the connection; a sender that cannot open the
cache, or a receiver that does not offer it, falls back to the data channel."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.multiprocessing as mp

from kvtransfer import sender as sender_module
from kvtransfer.registry import create_kv_transport
from kvtransfer.control import ControlClient
from kvtransfer.params import KVEndpoint
from kvtransfer.shared_cache import device_key, export_cache, open_cache
from kvtransfer import wire
from tests.kvtransfer.test_torch_dist import (BLOCK, COMPAT, HEADS, LAYERS, TRAILER, _wait_for, flat, make_cache,
                                              poll_until, send_part, ship_head_halves, ship_to_slots)

pytestmark = pytest.mark.timeout(120)
BOUND_S = 30.0  # every wait here takes well under a second


def make_shared_receiver(timeout_s: float = 5.0):
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(COMPAT, cache, 0, timeout_s=timeout_s, share_cache=True)
    host, port = rx.endpoint_address
    return rx, cache, KVEndpoint("d", 0, host, port)


def shared_sender(name: str = "p0"):
    return create_kv_transport("torch").sender(COMPAT, name, same_device=True)


def _child_write(desc: dict, queue) -> None:
    cache = open_cache(desc, torch.device("cpu"))
    queue.put(float(cache[1, 0, 2].sum()))  # what the parent wrote
    cache[0, 1, 3].fill_(5.0)


def test_a_cache_exported_here_is_the_same_memory_in_another_process():
    """Writes cross both ways between the exporting process and one that opened the description,
    and views of the cache taken before the export still see the shared memory."""
    cache = make_cache(fill=0.0)
    view = cache[0, 1]
    desc = export_cache(cache, head_offset=0)
    assert desc is not None and desc["kind"] == "cpu"
    cache[1, 0, 2].fill_(1.0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_write, args=(desc, queue))
    child.start()
    assert queue.get(timeout=BOUND_S) == cache[1, 0, 2].numel()
    child.join(BOUND_S)
    assert child.exitcode == 0
    assert bool((view[3] == 5.0).all()) and int((cache != 0).sum()) == 2 * view[3].numel()


@pytest.mark.parametrize("desc_change", [{"kind": "cuda"}, {"shape": [1, 2]}, {"dtype": "no_such_dtype"},
                                         {"handle": None}])
def test_a_malformed_description_is_refused(desc_change):
    """open_cache raises ValueError (which the sender logs and answers by using the data channel)."""
    desc = export_cache(make_cache(fill=0.0), head_offset=0) | desc_change
    with pytest.raises(ValueError):
        open_cache(desc, torch.device("cpu"))


def test_device_key_tells_devices_apart():
    """One process, one CPU: one key; it names the boot and the network namespace."""
    assert device_key(torch.device("cpu")) == device_key(torch.device("cpu")) != ""


@pytest.mark.parametrize("slots", [torch.arange(BLOCK, 4 * BLOCK),  # one run
                                   torch.cat([torch.arange(b * BLOCK, b * BLOCK + BLOCK)
                                              for b in (9, 1, 7, 3, 12, 5)])])  # 6 runs: scattered
def test_parts_are_written_straight_into_the_shared_cache(slots):
    """The decode cache equals the reference scatter; no data channel was built; every layer
    went through a grant."""
    rx, dst, dest = make_shared_receiver()
    tx = shared_sender()
    ship_to_slots(tx, rx, dest, dst, make_cache(), slots)
    assert tx.stats["shared_connections"] == 1 and tx.stats.get("groups_created", 0) == 0
    assert tx.stats["layers_shared"] == LAYERS and rx.stats["layers_direct"] == LAYERS
    tx.close(), rx.close()


def test_two_prefill_ranks_write_their_heads():
    """Each of two prefill ranks writes half the heads of the same slots (a TP mix)."""
    rx, dst, dest = make_shared_receiver()
    senders = [shared_sender(f"p{p}") for p in range(2)]
    ship_head_halves(rx, dest, dst, senders, torch.arange(2 * BLOCK, 4 * BLOCK + 3))
    assert all(tx.stats["layers_shared"] == LAYERS for tx in senders)
    for tx in senders:
        tx.close()
    rx.close()


def _child_send(dest: KVEndpoint, src: torch.Tensor, num_tokens: int, queue) -> None:
    tx = shared_sender("child")
    try:
        send_part(tx, "r", dest, src, torch.arange(num_tokens), 0, HEADS).wait(BOUND_S)
        queue.put(tx.stats.get("shared_connections", 0))
    finally:
        tx.close()


def test_a_sender_in_another_process_writes_into_the_cache():
    """The real arrangement: the prefill rank is another process on the same device."""
    rx, dst, dest = make_shared_receiver()
    src, slots = make_cache(), torch.arange(3 * BLOCK, 6 * BLOCK + 1)
    rx.expect("r", slots, 1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_send, args=(dest, src, len(slots), queue))
    child.start()
    assert queue.get(timeout=60) == 1
    child.join(BOUND_S)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    for layer in range(LAYERS):
        assert torch.equal(flat(dst, layer)[:, slots], flat(src, layer)[:, :len(slots)])
    rx.close()


class _HandSender:
    """A shared connection driven message by message, to hold a grant open."""

    def __init__(self, dest: KVEndpoint):
        self.client = ControlClient(dest.address, wire.SCHEMA)
        welcome = self.client.call({"kind": "hello", "sender_id": "hand", "compat": COMPAT.to_dict(),
                                    "device_key": device_key(torch.device("cpu"))}, 5)
        assert welcome["ok"] and welcome["cache"] is not None
        self.client.send({"kind": "join", "channel": welcome["channel"], "shared": True}, 5)

    def begin(self, rid: str) -> dict:
        return self.client.call({"kind": "begin", "request_id": rid, "head_start": 0, "head_end": HEADS,
                                 "num_tokens": BLOCK, "trace": ""}, 5)

    def done(self, rid: str) -> dict:
        return self.client.call({"kind": "done", "request_id": rid, "head_start": 0, "num_layers": LAYERS,
                                 "trailer_bytes": 0, "checksum": None, "mac": None}, 5)


def test_a_cancel_waits_for_the_granted_parts_done():
    """From `ready` to `done` a part's slots are the sender's: cancel() returns only after the
    `done`, which is then refused (the request is gone)."""
    rx, _, dest = make_shared_receiver()
    rx.expect("r", torch.arange(BLOCK), 1)
    hand = _HandSender(dest)
    assert hand.begin("r")["ok"]
    cancelled = threading.Event()
    threading.Thread(target=lambda: (rx.cancel("r"), cancelled.set()), daemon=True).start()
    assert not cancelled.wait(0.5)
    ack = hand.done("r")
    assert cancelled.wait(BOUND_S)
    assert not ack["ok"] and rx.stats["dropped_layers"] == LAYERS
    rx.close()


def test_a_layer_message_on_a_shared_connection_is_garbage():
    """A shared connection moves no payload and announces no layer: `layer` drops it, and the
    begun part's request fails."""
    rx, _, dest = make_shared_receiver()
    rx.expect("r", torch.arange(BLOCK), 1)
    hand = _HandSender(dest)
    assert hand.begin("r")["ok"]
    hand.client.send({"kind": "layer", "request_id": "r", "head_start": 0, "layer": 0, "count": 1}, 5)
    _, failed = poll_until(rx, timeout=BOUND_S)
    assert [rid for rid, _ in failed] == ["r"] and _wait_for(lambda: rx.stats["garbage_messages"] == 1, BOUND_S)
    rx.close()


def test_a_grant_never_ended_drops_the_connection():
    """Past timeout_s without the part's `done`, the connection is dropped: the request fails and
    a cancel no longer waits."""
    rx, _, dest = make_shared_receiver(timeout_s=1.0)
    rx.expect("r", torch.arange(BLOCK), 1)
    hand = _HandSender(dest)
    assert hand.begin("r")["ok"]
    _, failed = poll_until(rx, timeout=BOUND_S)
    assert [rid for rid, _ in failed] == ["r"]
    assert _wait_for(lambda: rx.stats.get("connections", 0) == 1 and not rx._sessions, BOUND_S)
    rx.cancel("r")
    rx.close()


def test_without_an_offer_the_data_channel_is_used():
    """A receiver that does not share its cache: a same-device sender builds the data channel."""
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(COMPAT, cache, 0, timeout_s=5.0)
    dest = KVEndpoint("d", 0, *rx.endpoint_address)
    tx = shared_sender()
    ship_to_slots(tx, rx, dest, cache, make_cache(), torch.arange(BLOCK, 3 * BLOCK))
    assert tx.stats["groups_created"] == 1 and "shared_connections" not in tx.stats
    tx.close(), rx.close()


def test_a_cache_that_cannot_be_opened_falls_back_to_the_data_channel(monkeypatch, caplog):
    """The sender logs why and joins the data channel; the part arrives all the same."""
    def refuse(desc, device):
        raise ValueError("no shared memory here")
    monkeypatch.setattr(sender_module, "open_cache", refuse)
    rx, dst, dest = make_shared_receiver()
    tx = shared_sender()
    with caplog.at_level(logging.WARNING, logger="kvtransfer.sender"):
        ship_to_slots(tx, rx, dest, dst, make_cache(), torch.arange(BLOCK, 3 * BLOCK))
    assert tx.stats["groups_created"] == 1 and "no shared memory here" in caplog.text
    tx.close(), rx.close()


def test_a_receiver_with_a_backends_own_layout_offers_no_cache_and_says_why(caplog):
    """share_cache with kv_views (vllm_cpu's own block layout): no cache is offered, and the log
    and `no_cache_reason` (sent to same-device senders) say why."""
    with caplog.at_level(logging.WARNING, logger="kvtransfer.receiver"):
        rx = create_kv_transport("torch").receiver(COMPAT, make_cache(fill=0.0), 0, timeout_s=5.0, share_cache=True,
                                                   kv_views=lambda layer: (layer[0], layer[1]))
    assert rx.shared_cache is None and "own KV blocks" in rx.no_cache_reason and rx.no_cache_reason in caplog.text
    rx.close()
