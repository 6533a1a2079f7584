"""Faults injected into a real transfer (a proxy on the control channel, a hand-made sender):
every deadline fires within a bound, both sides fail the request and free what it held, and the
pair serves the next request on a rebuilt connection. Deadlines here are 1 s."""
from __future__ import annotations

import time

import pytest
import torch

from kvtransfer import wire
from kvtransfer.base import TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.channel import SENDER, GlooChannel
from kvtransfer.rendezvous import join
from kvtransfer.control import ControlClient
from kvtransfer.receiver import MAX_DIRECT_RUNS
from tests.kvtransfer.faults import FaultProxy
from tests.kvtransfer.test_torch_dist import (COMPAT, HEADS, TRAILER, _wait_for, make_cache, make_receiver,
                                              poll_until, send_part)

pytestmark = pytest.mark.timeout(60)
DEADLINE_S = 1.0
BOUND_S = 10 * DEADLINE_S  # what a loaded 2-core machine may take; ~1-2 s measured


@pytest.fixture
def pair():
    rx, cache, dest = make_receiver(timeout_s=DEADLINE_S)
    proxy = FaultProxy(dest.address)
    tx = create_kv_transport("torch").sender(COMPAT, "p0", timeout_s=DEADLINE_S)
    yield rx, cache, proxy, tx
    tx.close(), proxy.close(), rx.close()


def serves_again(rx, proxy, tx) -> None:
    """After the fault: the proxy heals, a new request crosses on a new connection."""
    proxy.heal()
    rx.expect("next", torch.arange(4), 1)
    send_part(tx, "next", proxy.endpoint(), make_cache(), torch.arange(4), 0, HEADS).wait(BOUND_S)
    assert poll_until(rx)[0] == [("next", TRAILER)]


@pytest.mark.parametrize("phase", ["hello", "begin", "layer", "done"])
def test_a_silent_receiver_fails_the_transfer_at_each_step(pair, phase):
    """From `phase` on, the receiver's control connection swallows everything (no reset): the
    handshake, the reservation, a layer or the ack waits out its deadline; the sender fails the
    part and drops the pair. A receiver that saw the part begin fails it too once it has been
    silent for the deadline, and aborts that connection."""
    rx, cache, proxy, tx = pair
    proxy.blackhole_from = phase
    rx.expect("r", torch.arange(4), 1)
    start = time.monotonic()
    t = send_part(tx, "r", proxy.endpoint(), make_cache(), torch.arange(4), 0, HEADS)
    with pytest.raises(TransferError):
        t.wait(BOUND_S)
    assert time.monotonic() - start < BOUND_S and tx.num_groups == 0 and tx.stats["groups_failed"] == 1
    if phase in ("layer", "done"):  # the part began on the receiver
        done, failed = poll_until(rx, timeout=BOUND_S)
        assert done == [] and [rid for rid, _ in failed] == ["r"]
    else:  # nothing began there: the request stays reserved until its owner cancels it
        assert rx.poll() == ([], []) and rx.stats.get("bytes_received", 0) == 0
        rx.cancel("r")
    serves_again(rx, proxy, tx)


def test_delays_within_the_deadline_are_only_slow(pair):
    rx, cache, proxy, tx = pair
    proxy.delay_s = DEADLINE_S / 20
    rx.expect("r", torch.arange(4), 1)
    send_part(tx, "r", proxy.endpoint(), make_cache(), torch.arange(4), 0, HEADS).wait(BOUND_S)
    assert poll_until(rx)[0] == [("r", TRAILER)] and tx.stats.get("groups_failed", 0) == 0


def test_garbage_mid_part_fails_that_request_on_both_sides(pair):
    rx, cache, proxy, tx = pair
    proxy.garbage_at = "layer"
    rx.expect("r", torch.arange(4), 1)
    with pytest.raises(TransferError):
        send_part(tx, "r", proxy.endpoint(), make_cache(), torch.arange(4), 0, HEADS).wait(BOUND_S)
    done, failed = poll_until(rx, timeout=BOUND_S)
    assert done == [] and [rid for rid, _ in failed] == ["r"] and rx.stats["garbage_messages"] == 1
    serves_again(rx, proxy, tx)


@pytest.mark.parametrize("slots", [torch.arange(4), torch.arange(0, 2 * MAX_DIRECT_RUNS + 2, 2)],
                         ids=["straight-into-cache", "scattered"])
def test_an_announced_payload_that_never_comes(pair, slots):
    """A sender announces a layer and stops (its process hangs): the receive waits out its
    deadline, the request fails, the connection is aborted; nothing is written."""
    rx, cache, proxy, tx = pair
    dest = proxy.endpoint()
    client = ControlClient(dest.address, wire.SCHEMA)
    welcome = client.call({"kind": "hello", "sender_id": "stuck", "compat": COMPAT.to_dict(), "device_key": ""}, 5)
    store = join(dest.host, welcome["store_port"], welcome["store_prefix"], 5.0)
    client.send({"kind": "join", "channel": welcome["channel"], "shared": False}, 5)
    channel = GlooChannel(store, SENDER, "127.0.0.1", 5.0)
    rx.expect("r", slots, 1)
    ready = client.call({"kind": "begin", "request_id": "r", "head_start": 0, "head_end": HEADS,
                         "num_tokens": len(slots), "trace": ""}, 5)
    assert ready["ok"] and len(ready["runs"]) == (1 if len(slots) == 4 else 0)
    start = time.monotonic()
    client.send({"kind": "layer", "request_id": "r", "head_start": 0, "layer": 0, "count": 1}, 5)
    done, failed = poll_until(rx, timeout=BOUND_S)
    assert done == [] and [rid for rid, _ in failed] == ["r"] and time.monotonic() - start < BOUND_S
    # the part's silence and the receive's own deadline are both 1 s: either may fail the request first
    assert _wait_for(lambda: rx.stats.get("payload_failures", 0) > 0, BOUND_S)
    assert rx.stats["payload_failures"] == 1 and cache.abs().sum() == 0
    channel.close(), client.close()
    serves_again(rx, proxy, tx)
