"""KV checksums (`kv_checksum` in both ends' CompatRecord): the checksum is the one of the payload
bytes in the order they cross; checked parts arrive on every path (received into the cache,
scattered, a TP mix, written by a same-device sender); one element altered in flight fails the
part with a checksum mismatch, counted, and the pair serves on; without checksums the same
alteration lands in the cache unnoticed when payload MACs are off too (the negative control; with
them on it is caught: test_payload_mac.py); the two ends must agree, and a
`done` that breaks the agreement is garbage."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import pytest
import torch
import xxhash

from kvtransfer import sender as sender_module
from kvtransfer.base import IncompatiblePeerError, TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.wire import PartChecksum, checksum_of
from kvtransfer.params import KVEndpoint
from kvtransfer.receiver import MAX_DIRECT_RUNS, TorchDistReceiver
from kvtransfer.sender import TorchDistSender
from kvtransfer.scatter import SharedCacheWriter
from tests.kvtransfer.faults import OFFSET, corrupt_in_flight
from tests.kvtransfer.test_receive_direct import _slots
from tests.kvtransfer.test_torch_dist import (COMPAT, HEADS, LAYERS, TRAILER, _wait_for, flat, make_cache,
                                              make_receiver, poll_until, send_part)

pytestmark = pytest.mark.timeout(60)
CHECKED = replace(COMPAT, kv_checksum=True)
BOUND_S = 30.0  # every wait here takes well under a second


def test_the_checksum_is_xxh3_of_the_bytes_in_order():
    """Updating payload by payload equals xxh3_64 of their bytes back to back, whatever the dtype;
    another order, or one element altered, gives another checksum."""
    a, b = torch.randn(3, 5), torch.randn(7).to(torch.bfloat16)
    raw = a.numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    assert checksum_of([a, b]) == xxhash.xxh3_64(raw).intdigest()
    assert checksum_of([a.view(torch.uint8), b.view(torch.int16)]) == checksum_of([a, b])
    assert checksum_of([a.t()]) == checksum_of([a.t().contiguous()])
    assert checksum_of([b, a]) != checksum_of([a, b])
    altered = a.clone()
    altered[1, 2] += OFFSET
    assert checksum_of([altered, b]) != checksum_of([a, b])
    c = PartChecksum()
    assert 0 <= c.value < 2**64 and c.value == xxhash.xxh3_64(b"").intdigest()


def shared_receiver(compat=CHECKED):
    cache = make_cache(fill=0.0)
    rx = create_kv_transport("torch").receiver(compat, cache, 0, timeout_s=5.0, share_cache=True)
    return rx, cache, KVEndpoint("d", 0, *rx.endpoint_address)


# path -> (stretches of slots, parts (two: a TP mix, half the heads each), same device)
PATHS = {"direct": (1, 1, False), "direct_max": (MAX_DIRECT_RUNS, 1, False),
         "scattered": (MAX_DIRECT_RUNS + 1, 1, False), "tp_mix": (2, 2, False),
         "shared": (1, 1, True), "shared_gathered": (MAX_DIRECT_RUNS + 1, 1, True), "shared_tp_mix": (2, 2, True)}


def ship(path: str, corrupt: bool = False, compat=CHECKED, payload_mac: bool = True):
    """Ships request "r" on `path` (PATHS), altering one element of layer 1 in flight when
    `corrupt`; `payload_mac=False`: both ends without payload MACs (bench's switch). Returns
    (receiver, its cache, source cache, slots, per-part errors, receiver's poll, what was
    altered); closes both ends."""
    num_runs, num_parts, shared = PATHS[path]
    rx, dst, dest = shared_receiver(compat) if shared else make_receiver(compat=compat)
    if not payload_mac:
        rx.close()
        rx = TorchDistReceiver(compat, dst, 0, timeout_s=5.0, payload_mac=False)
        dest = KVEndpoint("d", 0, *rx.endpoint_address)
    slots = _slots(num_runs)
    heads = [(p * HEADS // num_parts, (p + 1) * HEADS // num_parts) for p in range(num_parts)]
    rx.expect("r", slots, len(heads))
    src, errors, altered = make_cache(), [], []
    senders = [TorchDistSender(compat, f"p{i}", same_device=shared, payload_mac=payload_mac) for i in range(len(heads))]
    with corrupt_in_flight(layer=1, times=1) if corrupt else contextlib.nullcontext() as fault:
        for tx, (lo, hi) in zip(senders, heads):
            try:
                send_part(tx, "r", dest, src, torch.arange(len(slots)), lo, hi,
                          trailer=TRAILER if lo == 0 else b"").wait(BOUND_S)
                errors.append(None)
            except TransferError as exc:
                errors.append(str(exc))
        altered = [] if fault is None else list(fault.altered)
    polled = poll_until(rx)
    for tx in senders:
        tx.close()
    rx.close()
    if shared:
        assert senders[0].stats["layers_shared"] > 0
    return rx, dst, src, slots, errors, polled, altered


def reference(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    want = torch.zeros_like(src)
    for layer in range(src.shape[0]):
        flat(want, layer)[:, slots] = flat(src, layer)[:, :len(slots)]
    return want


@pytest.mark.parametrize("path", list(PATHS))
def test_checked_parts_arrive_on_every_path(path):
    """Sender and receiver hash the same bytes in the same order on every path: the request
    completes, the cache holds the sent KV, no mismatch is counted."""
    rx, dst, src, slots, errors, (done, failed), _ = ship(path)
    landed = "layers_scattered" if path in ("scattered", "tp_mix") else "layers_direct"
    assert rx.stats[landed] == LAYERS * PATHS[path][1]
    assert errors == [None] * len(errors) and failed == [] and [c.request_id for c in done] == ["r"]
    assert torch.equal(dst, reference(src, slots))
    assert rx.stats.get("kv_checksum_mismatches", 0) == 0


@pytest.mark.parametrize("path", ["direct", "scattered", "tp_mix"])
def test_one_element_altered_in_flight_fails_the_part(path):
    """corrupt_in_flight alters one element of layer 1 of one part: its ack names the checksum
    mismatch, the receiver fails the request, counts one mismatch."""
    rx, _, _, _, errors, (done, failed), altered = ship(path, corrupt=True)
    assert len(altered) == 1 and altered[0].request_id == "r" and altered[0].layer == 1
    assert altered[0].after == pytest.approx(altered[0].before + OFFSET, abs=1e-3)
    assert sum(e is not None and "KV checksum mismatch" in e for e in errors) == 1
    assert done == [] and len(failed) == 1 and "KV checksum mismatch" in failed[0][1]
    assert rx.stats["kv_checksum_mismatches"] == 1 and rx.stats["failed"] == 1


def test_without_checksums_the_altered_element_lands_unnoticed():
    """The negative control: checksums and payload MACs off, the same alteration completes the
    request, and the cache differs from the sent KV in exactly that element (layer 1, K, first
    token and head)."""
    rx, dst, src, slots, errors, (done, failed), altered = ship("direct", corrupt=True, compat=COMPAT,
                                                                payload_mac=False)
    assert errors == [None] and failed == [] and len(done) == 1 and len(altered) == 1
    assert altered[0].before == float(flat(src, 1)[0, 0, 0, 0])  # the sender's own KV is intact
    diff = (dst - reference(src, slots)).nonzero().tolist()
    assert diff == [[1, 0, *divmod(int(slots[0]), dst.shape[3]), 0, 0]]
    assert float(flat(dst, 1)[0, slots[0], 0, 0] - flat(src, 1)[0, 0, 0, 0]) == pytest.approx(OFFSET, abs=1e-3)


@pytest.mark.parametrize("path", ["shared", "shared_gathered"])
def test_a_same_device_write_that_lands_wrong_is_caught_by_reading_back(path):
    """Same device: the receiver reads its slots back at `done`; an element changed after the
    sender's write (its checksum taken from the source) fails the part as a mismatch."""
    write = SharedCacheWriter.write

    def write_then_alter(self, layer, target, kv, ready, head_start):
        write(self, layer, target, kv, ready, head_start)
        if layer == 1:
            _, _, slot = target[0][0]
            self.cache[1].view(2, self.num_slots, self.num_heads, -1)[0, slot, 0, 0] += OFFSET

    with mock.patch.object(SharedCacheWriter, "write", write_then_alter):
        rx, _, _, _, errors, (done, failed), _ = ship(path)
    assert done == [] and len(failed) == 1 and "KV checksum mismatch" in errors[0]
    assert rx.stats["kv_checksum_mismatches"] == 1


def test_both_ends_must_agree_on_checksums():
    """A sender with checksums and a receiver without refuse each other at the handshake, naming
    kv_checksum; nothing is written."""
    rx, dst, dest = make_receiver(compat=COMPAT)
    rx.expect("r", torch.arange(3), 1)
    tx = create_kv_transport("torch").sender(CHECKED, "p0")
    with pytest.raises(IncompatiblePeerError, match="kv_checksum"):
        send_part(tx, "r", dest, make_cache(), torch.arange(3), 0, HEADS).wait(BOUND_S)
    assert rx.stats["refused_peers"] == 1 and dst.abs().sum() == 0
    tx.close(), rx.close()


def test_a_done_without_the_agreed_checksum_is_garbage(monkeypatch):
    """A sender that agreed to checksums and sends `done` without one is malformed: its
    connection is dropped and counted, the request fails on both ends."""
    rx, _, dest = make_receiver(compat=CHECKED)
    rx.expect("r", torch.arange(3), 1)
    monkeypatch.setattr(sender_module, "PartChecksum", lambda: None)
    tx = create_kv_transport("torch").sender(CHECKED, "p0")
    with pytest.raises(TransferError):
        send_part(tx, "r", dest, make_cache(), torch.arange(3), 0, HEADS).wait(BOUND_S)
    done, failed = poll_until(rx)
    assert done == [] and [rid for rid, _ in failed] == ["r"]
    assert _wait_for(lambda: rx.stats["garbage_messages"] == 1)
    tx.close(), rx.close()
