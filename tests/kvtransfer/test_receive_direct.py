"""Receiving straight into the cache: a part with all of a rank's heads whose slots form at most
MAX_DIRECT_RUNS stretches is received run by run into the cache (no buffer, no scatter); layers
queued at the sender go out under one announcement; a cancel waits for a receive in flight."""
from __future__ import annotations

import threading

import pytest
import torch

from kvtransfer import wire
from kvtransfer.registry import create_kv_transport
from kvtransfer.channel import SENDER, GlooChannel
from kvtransfer.rendezvous import join
from kvtransfer.control import ControlClient
from kvtransfer.receiver import MAX_DIRECT_RUNS
from kvtransfer.scatter import slot_runs
from tests.kvtransfer.faults import FaultProxy
from tests.kvtransfer.test_torch_dist import (BLOCK, BLOCKS, COMPAT, HEADS, LAYERS, TRAILER, _wait_for, flat,
                                              make_cache, make_receiver, poll_until, send_part, ship_head_halves,
                                              ship_to_slots)

BOUND_S = 30.0  # every wait here takes well under a second


def _slots(num_runs: int) -> torch.Tensor:
    """num_runs stretches of 3, 5, 3, 5, ... slots, a gap of one slot between them."""
    out, start = [], 1
    for i in range(num_runs):
        length = 3 if i % 2 == 0 else 5
        out.append(torch.arange(start, start + length))
        start += length + 1
    return torch.cat(out)


@pytest.mark.parametrize("num_runs", [1, MAX_DIRECT_RUNS, MAX_DIRECT_RUNS + 1])
def test_runs_received_straight_into_the_cache_up_to_the_limit(num_runs):
    """The cache equals the reference scatter of the sent KV; up to the limit every layer is
    received straight into it, beyond it every layer is scattered."""
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    src, slots = make_cache(), _slots(num_runs)
    assert len(slot_runs(slots)) == num_runs
    ship_to_slots(tx, rx, dest, dst, src, slots)
    direct = num_runs <= MAX_DIRECT_RUNS
    assert rx.stats.get("layers_direct", 0) == LAYERS * direct
    assert rx.stats.get("layers_scattered", 0) == LAYERS * (not direct)
    tx.close(), rx.close()


def test_parts_with_some_of_the_heads_are_scattered():
    """Two prefill ranks each send half the heads to one decode rank: contiguous slots, but each
    part fills every slot's row only partly, so it is received into a buffer and scattered."""
    rx, dst, dest = make_receiver()
    senders = [create_kv_transport("torch").sender(COMPAT, f"p{p}") for p in range(2)]
    ship_head_halves(rx, dest, dst, senders, torch.arange(BLOCK, 3 * BLOCK))
    assert rx.stats["layers_scattered"] == 2 * LAYERS and rx.stats.get("layers_direct", 0) == 0
    [tx.close() for tx in senders], rx.close()


def test_layers_queued_at_the_sender_go_under_one_announcement():
    """While `begin` waits for its answer (each control message delayed), every layer is queued:
    one `layer` message announces them all, and all of them land."""
    rx, dst, _ = make_receiver()
    proxy = FaultProxy(rx.endpoint_address)
    proxy.delay_s = 0.05
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    src, slots = make_cache(), torch.arange(2 * BLOCK)
    rx.expect("r", slots, 1)
    send_part(tx, "r", proxy.endpoint(), src, slots, 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    assert proxy.seen.count("layer") == 1 and rx.stats["layers_direct"] == LAYERS
    assert torch.equal(dst[:, :, :2], src[:, :, :2])
    tx.close(), proxy.close(), rx.close()


class _HandSender:
    """A sender driven by hand: its control connection and data channel, nothing else."""

    def __init__(self, dest):
        self.client = ControlClient(dest.address, wire.SCHEMA)
        welcome = self.client.call({"kind": "hello", "sender_id": "hand", "compat": COMPAT.to_dict(),
                                    "device_key": ""}, 5)
        store = join(dest.host, welcome["store_port"], welcome["store_prefix"], 5.0)
        self.client.send({"kind": "join", "channel": welcome["channel"], "shared": False}, 5)
        self.channel = GlooChannel(store, SENDER, "127.0.0.1", 5.0)

    def begin(self, rid: str, num_tokens: int) -> dict:
        return self.client.call({"kind": "begin", "request_id": rid, "head_start": 0, "head_end": HEADS,
                                 "num_tokens": num_tokens, "trace": ""}, 5)

    def announce(self, rid: str, layer: int, count: int) -> None:
        self.client.send({"kind": "layer", "request_id": rid, "head_start": 0, "layer": layer, "count": count}, 5)

    def close(self) -> None:
        self.channel.close(), self.client.close()


def test_cancel_waits_for_a_receive_in_flight_into_the_slots():
    """A layer is announced and its receive posted into the request's slots; cancel() does not
    return until that receive ended, and a later layer of the cancelled request is dropped."""
    rx, dst, dest = make_receiver()
    hand = _HandSender(dest)
    slots = torch.arange(BLOCK, 2 * BLOCK)
    rx.expect("r", slots, 1)
    assert hand.begin("r", len(slots))["runs"] == [[0, len(slots)]]
    hand.announce("r", 0, 1)
    assert _wait_for(lambda: rx._expected["r"].receiving == 1, BOUND_S)
    cancelled = threading.Event()
    threading.Thread(target=lambda: (rx.cancel("r"), cancelled.set()), daemon=True).start()
    assert not cancelled.wait(0.5)  # the receive into r's slots is still in flight
    kv = torch.randn(2, len(slots), HEADS * COMPAT.head_dim)
    for half in kv:  # the run's K, then its V
        hand.channel.send(half.contiguous().view(torch.uint8).view(-1), 5)
    assert cancelled.wait(BOUND_S)
    assert torch.equal(flat(dst, 0)[:, slots].reshape(kv.shape), kv)  # landed before cancel returned
    hand.announce("r", 1, 1)
    for half in kv:
        hand.channel.send(half.contiguous().view(torch.uint8).view(-1), 5)
    # layer 0 landed after cancel() took the request away (counted dropped), layer 1 went to a scratch buffer
    assert _wait_for(lambda: rx.stats.get("dropped_layers", 0) == 2, BOUND_S)
    assert flat(dst, 1).abs().sum() == 0 and dst[2].abs().sum() == 0
    assert rx.poll() == ([], []) and BLOCKS * BLOCK > len(slots)
    hand.close(), rx.close()
