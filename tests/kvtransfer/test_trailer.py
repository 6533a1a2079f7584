"""A part's trailer (kvtransfer/base.py: bytes the transport carries unread): bit-equal on arrival
over the data channel and through the shared cache, in several chunks; refused where the ends'
trailer formats disagree; a `done` whose length disagrees with its chunks, or a chunk past the
bound, is garbage (counted, the connection dropped); a cancelled request's is dropped with it."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kvtransfer import wire
from kvtransfer.base import IncompatiblePeerError
from kvtransfer.registry import create_kv_transport
from kvtransfer.params import KVEndpoint
from tests.kvtransfer.test_torch_dist import (COMPAT, HEADS, LAYERS, _raw_connection, _wait_for, flat, make_cache,
                                              poll_until)

pytestmark = pytest.mark.timeout(60)
FORMAT_COMPAT = replace(COMPAT, trailer_format="handover-1+rows:eagle3 192 wide")


def pair(shared: bool, rx_compat=FORMAT_COMPAT, tx_compat=FORMAT_COMPAT):
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(rx_compat, cache, 0, timeout_s=5.0, share_cache=shared)
    host, port = rx.endpoint_address
    return rx, create_kv_transport("torch").sender(tx_compat, "p0", same_device=shared), KVEndpoint("d", 0, host, port)


def begin_part(tx, dest, rid: str):
    src = make_cache()
    t = tx.begin(rid, dest, 0, HEADS, 4)
    for layer in range(LAYERS):
        t.send_layer(layer, flat(src, layer)[:, :4].clone())
    return t


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("size", [0, 1, 2 * wire.TRAILER_CHUNK_BYTES + 5])
def test_the_trailer_arrives_bit_equal_in_chunks(shared, size):
    rx, tx, dest = pair(shared)
    trailer = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
    rx.expect("r", torch.arange(4), 1)
    t = begin_part(tx, dest, "r")
    t.finish(trailer)
    t.wait(10)
    assert poll_until(rx)[0] == [("r", trailer)]
    assert tx.stats.get("trailer_bytes_sent", 0) == rx.stats.get("trailer_bytes_received", 0) == size
    assert (tx.stats.get("shared_connections", 0) == 1) == shared
    tx.close(), rx.close()


def test_ends_that_disagree_on_the_trailer_format_are_refused():
    rx, tx, dest = pair(False, rx_compat=COMPAT)
    rx.expect("r", torch.arange(4), 1)
    t = begin_part(tx, dest, "r")
    t.finish(b"x")
    with pytest.raises(IncompatiblePeerError, match="trailer_format"):
        t.wait(10)
    tx.close(), rx.close()


def test_a_done_whose_length_disagrees_with_its_chunks_is_garbage():
    rx, tx, dest = pair(False)
    rx.expect("r", torch.arange(4), 1)
    client = _raw_connection(dest, FORMAT_COMPAT)
    ready = client.call({"kind": "begin", "request_id": "r", "head_start": 0, "head_end": HEADS, "num_tokens": 4,
                         "trace": ""}, 5)
    assert ready["ok"]
    client.send({"kind": "trailer", "request_id": "r", "head_start": 0, "data": b"abc"}, 5)
    client.send({"kind": "done", "request_id": "r", "head_start": 0, "num_layers": 0, "trailer_bytes": 4,
                 "checksum": None, "mac": None}, 5)
    assert _wait_for(lambda: rx.stats["garbage_messages"] == 1)
    client.close()
    done, failed = poll_until(rx)
    assert done == [] and [rid for rid, _ in failed] == ["r"]  # dropped with its connection
    tx.close(), rx.close()


def test_a_cancelled_requests_trailer_is_dropped_with_it():
    rx, tx, dest = pair(False)
    rx.expect("gone", torch.arange(4), 1)
    t = begin_part(tx, dest, "gone")
    assert _wait_for(lambda: rx.stats.get("layers_direct", 0) + rx.stats.get("layers_scattered", 0) == LAYERS)
    rx.cancel("gone")
    t.finish(b"for nobody")
    with pytest.raises(Exception, match="unknown or cancelled"):
        t.wait(10)
    time.sleep(0.2)
    assert rx.poll() == ([], []) and rx.stats["unknown_requests"] == 1
    tx.close(), rx.close()


def test_one_request_takes_one_trailer():
    """Two parts of one request (a TP mix) that both carry a trailer: the request fails, named."""
    rx, tx, dest = pair(False)
    other = create_kv_transport("torch").sender(FORMAT_COMPAT, "p1")
    rx.expect("r", torch.arange(4), 2)
    src, half = make_cache(), HEADS // 2
    for p, sender in enumerate((tx, other)):
        t = sender.begin("r", dest, p * half, (p + 1) * half, 4)
        for layer in range(LAYERS):
            t.send_layer(layer, flat(src, layer)[:, :4, p * half:(p + 1) * half].clone())
        t.finish(b"mine")
        if p == 0:
            t.wait(10)
    with pytest.raises(Exception, match="a second part carried a trailer"):
        t.wait(10)
    done, failed = poll_until(rx)
    assert done == [] and failed == [("r", "a second part carried a trailer")]
    other.close(), tx.close(), rx.close()


def test_a_trailer_past_the_bound_is_refused_by_the_sender():
    rx, tx, dest = pair(False)
    t = begin_part(tx, dest, "r")
    with pytest.raises(ValueError, match="trailer of"):
        t.finish(_Huge())
    tx.close(), rx.close()


class _Huge(bytes):
    """A trailer that says it is past the bound without holding a gigabyte."""

    def __len__(self) -> int:
        return (1 << 30) + 1
