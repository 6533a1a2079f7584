"""A speculative head's rows of the prompt, shipped with a part's KV (wire.py `rows`): bit-equal on
arrival over the data channel and through the shared cache, in several chunks; refused where the
ends' compat records disagree; malformed ones dropped and counted; a cancelled request's dropped."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kvtransfer import wire
from kvtransfer.base import IncompatiblePeerError, create_kv_transport
from kvtransfer.params import KVEndpoint
from tests.kvtransfer.test_torch_dist import (COMPAT, HEADS, LAYERS, _raw_connection, _wait_for, flat, make_cache,
                                              poll_until)

pytestmark = pytest.mark.timeout(60)
ROWS_COMPAT = replace(COMPAT, proposer_rows="eagle3: inputs of layers 2,1,0, 192 wide, float32")


def pair(shared: bool, rx_compat=ROWS_COMPAT, tx_compat=ROWS_COMPAT):
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(rx_compat, cache, 0, timeout_s=5.0, share_cache=shared)
    host, port = rx.endpoint_address
    return rx, create_kv_transport("torch").sender(tx_compat, "p0", same_device=shared), KVEndpoint("d", 0, host, port)


def ship(tx, dest, rid: str, rows) -> None:
    src = make_cache()
    t = tx.begin(rid, dest, 0, HEADS, 4)
    for layer in range(LAYERS):
        t.send_layer(layer, flat(src, layer)[:, :4].clone())
    t.finish(7, None, (), rows)
    t.wait(10)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_arrive_bit_equal_in_chunks(shared, dtype):
    """1,500 rows of 192: 1.1 MiB in float32, three messages of at most 512 KiB."""
    rx, tx, dest = pair(shared)
    rows = torch.randn(1500, 192).to(dtype)
    rx.expect("r", torch.arange(4), 1)
    ship(tx, dest, "r", (3, rows))
    assert poll_until(rx)[0] == [("r", 7, None, ())]
    start, got = rx.take_rows("r")
    assert start == 3 and got.dtype == dtype and torch.equal(got, rows) and rx.take_rows("r") is None
    assert tx.stats["rows_bytes_sent"] == rx.stats["rows_bytes_received"] == rows.numel() * rows.element_size()
    assert (tx.stats.get("shared_connections", 0) == 1) == shared
    tx.close(), rx.close()


def test_a_part_without_rows_has_none():
    rx, tx, dest = pair(False)
    rx.expect("r", torch.arange(4), 1)
    ship(tx, dest, "r", None)
    assert poll_until(rx)[0] == [("r", 7, None, ())] and rx.take_rows("r") is None
    tx.close(), rx.close()


def test_ends_that_disagree_on_rows_are_refused():
    rx, tx, dest = pair(False, rx_compat=COMPAT)
    rx.expect("r", torch.arange(4), 1)
    with pytest.raises(IncompatiblePeerError, match="proposer_rows"):
        ship(tx, dest, "r", (0, torch.randn(4, 192)))
    tx.close(), rx.close()


def test_malformed_rows_are_garbage_and_a_cancelled_requests_are_dropped():
    """Rows whose bytes do not fill their shape: the connection is dropped and counted. Rows of a
    request cancelled meanwhile: received, dropped, counted, never handed out."""
    rx, tx, dest = pair(False)
    msg = wire.rows_messages("x", 0, 0, torch.randn(2, 8))[0]
    with pytest.raises(wire.WireError, match="bytes for 2 rows"):
        wire.check_message({**msg, "data": msg["data"][:-4]}, wire.SCHEMA)
    client = _raw_connection(dest, ROWS_COMPAT)
    client._conn.send({**msg, "data": msg["data"][:-4]}, time.monotonic() + 5)  # framed, never checked
    assert _wait_for(lambda: rx.stats["garbage_messages"] == 1)
    client.close()
    rx.expect("gone", torch.arange(4), 1)
    src = make_cache()
    t = tx.begin("gone", dest, 0, HEADS, 4)
    for layer in range(LAYERS):
        t.send_layer(layer, flat(src, layer)[:, :4].clone())
    assert _wait_for(lambda: rx.stats.get("layers_direct", 0) + rx.stats.get("layers_scattered", 0) == LAYERS)
    rx.cancel("gone")
    t.finish(7, None, (), (0, torch.randn(4, 192)))
    assert _wait_for(lambda: rx.stats.get("dropped_rows", 0) == 1) and rx.take_rows("gone") is None
    tx.close(), rx.close()
