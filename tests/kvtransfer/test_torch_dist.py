"""The torch.distributed KV transport, both ends in one process (each pair group's two ranks on
separate threads): bytes land in the reserved slots exactly, failures are bounded and counted."""
from __future__ import annotations

import gc
import multiprocessing as mp
import time
from typing import NamedTuple

import pytest
import torch

from kvtransfer import wire
from kvtransfer.base import IncompatiblePeerError, TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.params import CompatRecord, KVEndpoint, expected_parts, kv_heads_of_rank, plan_head_slices
from kvtransfer.channel import SENDER, GlooChannel
from kvtransfer.rendezvous import join
from kvtransfer.control import ControlClient
from kvtransfer.receiver import MAX_DIRECT_RUNS

LAYERS, HEADS, HEAD_DIM, BLOCKS, BLOCK = 3, 4, 8, 16, 4
COMPAT = CompatRecord("tiny", "float32", LAYERS, HEADS, HEAD_DIM, block_size=BLOCK)
TRAILER = b"\x07 and what else a request's KV comes with"  # the transport carries it unread (base.py)
pytestmark = pytest.mark.timeout(60)


def make_cache(local_heads: int = HEADS, fill: float | None = None) -> torch.Tensor:
    shape = (LAYERS, 2, BLOCKS, BLOCK, local_heads, HEAD_DIM)
    return torch.randn(shape) if fill is None else torch.full(shape, fill)


def flat(cache: torch.Tensor, layer: int) -> torch.Tensor:
    return cache[layer].view(2, BLOCKS * BLOCK, cache.shape[4], HEAD_DIM)


def make_receiver(local_heads=HEADS, head_offset=0, compat=COMPAT, timeout_s=5.0):
    # NOTE: closed receivers in reference cycles keep their TCPStore masters until collected, and
    # torch's TCPStore refuses connections once a process holds about eight masters with a client
    gc.collect()
    cache = make_cache(local_heads, fill=0.0)
    rx = create_kv_transport("torch").receiver(compat, cache, head_offset, timeout_s=timeout_s)
    host, port = rx.endpoint_address
    return rx, cache, KVEndpoint("d", 0, host, port)


def send_part(tx, rid, dest, src_cache, src_slots, head_start, head_end, trailer=TRAILER, src_head_offset=0):
    """Ships heads [head_start, head_end) of src_cache's `src_slots`, every layer; returns the Transfer."""
    t = tx.begin(rid, dest, head_start, head_end, len(src_slots))
    lo = head_start - src_head_offset
    for layer in range(LAYERS):
        t.send_layer(layer, flat(src_cache, layer)[:, src_slots, lo:lo + head_end - head_start].clone())
    t.finish(trailer)
    return t


def ship_to_slots(tx, rx, dest, dst, src, slots) -> None:
    """Sends src's first len(slots) tokens (all heads) into `slots`: the receiver's cache `dst`
    must then equal the per-token reference scatter, zeros elsewhere."""
    rx.expect("r", slots, 1)
    send_part(tx, "r", dest, src, torch.arange(len(slots)), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    expected = torch.zeros_like(dst)
    for layer in range(LAYERS):
        flat(expected, layer)[:, slots] = flat(src, layer)[:, :len(slots)]
    assert torch.equal(dst, expected)


def ship_head_halves(rx, dest, dst, senders, slots) -> None:
    """Two prefill ranks each ship half the heads of the same tokens into `slots` (a TP mix): the
    receiver reports the request once, and its cache `dst` holds every head at those slots."""
    full = make_cache()
    rx.expect("r", slots, 2)
    half = HEADS // 2
    for p, tx in enumerate(senders):
        send_part(tx, "r", dest, full, torch.arange(len(slots)), p * half, (p + 1) * half,
                  trailer=TRAILER if p == 0 else b"").wait(10)  # the sampling rank's part carries it
    assert poll_until(rx)[0] == [("r", TRAILER)]
    for layer in range(LAYERS):
        assert torch.equal(flat(dst, layer)[:, slots], flat(full, layer)[:, :len(slots)])


class Received(NamedTuple):
    """What a test compares of a CompletedTransfer (its trace fields: test_a_parts_traceparent_crosses_...)."""
    request_id: str
    trailer: bytes


def poll_until(rx, n_events=1, timeout=10.0, traces: list | None = None):
    """(completed as Received (request id, trailer) pairs, failed) once `n_events` came; `traces` gets
    each completed one's (trace, began_ns)."""
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < n_events and time.monotonic() < deadline:
        d, f = rx.poll()
        done += [Received(c.request_id, c.trailer) for c in d]
        if traces is not None:
            traces += [(c.trace, c.began_ns) for c in d]
        failed += f
        time.sleep(0.01)
    return done, failed


def test_round_trip_bytes_land_in_reserved_slots():
    """The receiver's cache at the reserved slots equals the sender's KV (checksums, every layer),
    other slots stay untouched, and poll reports the request with its trailer, bytes unchanged."""
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    src = make_cache()
    src_slots, dst_slots = torch.tensor([5, 6, 7, 20, 21]), torch.tensor([40, 41, 42, 60, 3])
    rx.expect("r1", dst_slots, num_parts=1)
    trailer = bytes(range(256)) * 3
    send_part(tx, "r1", dest, src, src_slots, 0, HEADS, trailer=trailer).wait(10)
    done, failed = poll_until(rx)
    assert done == [("r1", trailer)] and failed == []
    for layer in range(LAYERS):
        sent, got = flat(src, layer)[:, src_slots], flat(dst, layer)[:, dst_slots]
        assert torch.equal(sent, got) and sent.sum().item() == pytest.approx(got.sum().item())
    mask = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    mask[dst_slots] = False
    assert flat(dst, 0)[:, mask].abs().sum() == 0
    assert rx.stats["bytes_received"] == tx.stats["bytes_sent"] == LAYERS * 2 * 5 * HEADS * HEAD_DIM * 4
    assert tx.stats["groups_created"] == 1 and tx.stats["parts_sent"] == 1
    tx.close(), rx.close()


@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 8)])
def test_heterogeneous_tp_each_decode_rank_gets_its_heads(ptp, dtp):
    """Prefill ranks slice heads per the plan; every decode rank's cache ends equal to the full
    KV's slice of its own heads (including tp > num_kv_heads, heads replicated)."""
    full = make_cache()
    slots = torch.arange(9)
    receivers = []
    for d in range(dtp):
        heads = kv_heads_of_rank(HEADS, dtp, d)
        rx, cache, ep = make_receiver(len(heads), heads.start)
        receivers.append((rx, cache, KVEndpoint("d", d, ep.host, ep.port), heads))
        rx.expect("r", slots + 10, expected_parts(HEADS, ptp, dtp, d))
    senders = [create_kv_transport("torch").sender(COMPAT, f"p{p}") for p in range(ptp)]
    transfers = []
    for s in plan_head_slices(HEADS, ptp, dtp):
        held = kv_heads_of_rank(HEADS, ptp, s.prefill_rank)
        local = full[:, :, :, :, held.start:held.stop]  # what prefill rank p holds
        transfers.append(send_part(senders[s.prefill_rank], "r", receivers[s.decode_rank][2], local.contiguous(),
                                   slots, s.head_start, s.head_end, trailer=TRAILER if s.prefill_rank == 0 else b"",
                                   src_head_offset=held.start))
    for t in transfers:
        t.wait(10)
    for d, (rx, cache, _, heads) in enumerate(receivers):
        done, failed = poll_until(rx)
        from_rank0 = any(s.prefill_rank == 0 and s.decode_rank == d for s in plan_head_slices(HEADS, ptp, dtp))
        assert failed == [] and done == [("r", TRAILER if from_rank0 else b"")]
        for layer in range(LAYERS):
            assert torch.equal(flat(cache, layer)[:, slots + 10], flat(full, layer)[:, slots, heads.start:heads.stop])
        rx.close()
    for tx in senders:
        tx.close()


def test_incompatible_peer_refused_with_clear_error():
    """A receiver of another dtype refuses the handshake: the sender's wait names the field,
    nothing is written, the receiver counts the refusal."""
    other = CompatRecord("tiny", "bfloat16", LAYERS, HEADS, HEAD_DIM)
    rx, dst, dest = make_receiver(compat=other)
    rx.expect("r1", torch.arange(3), 1)
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    t = send_part(tx, "r1", dest, make_cache(), torch.arange(3), 0, HEADS)
    with pytest.raises(IncompatiblePeerError, match="dtype"):
        t.wait(10)
    assert rx.stats["refused_peers"] == 1 and dst.abs().sum() == 0
    tx.close(), rx.close()


def _raw_connection(dest: KVEndpoint, compat: CompatRecord = COMPAT) -> ControlClient:
    """A hand-made sender connection past the handshake, to send what the real sender never would."""
    client = ControlClient(dest.address, wire.SCHEMA)
    welcome = client.call({"kind": "hello", "sender_id": "evil", "compat": compat.to_dict(), "device_key": ""}, 5)
    assert welcome["ok"]
    store = join(dest.host, welcome["store_port"], welcome["store_prefix"], 5.0)
    client.send({"kind": "join", "channel": welcome["channel"], "shared": False}, 5)
    client.channel = GlooChannel(store, SENDER, "127.0.0.1", 5.0)  # kept: a collected one closes its end
    return client


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("garbage", [b"\xc1\xc1\xc1", {"kind": "ack", "request_id": "r", "ok": True, "error": None},
                                     {"kind": "layer", "request_id": "r", "head_start": 0, "layer": 0, "count": 1}])
def test_garbage_dropped_counted_and_serving_goes_on(garbage):
    """Bytes that are not msgpack, a message a receiver never gets, a layer of a part that did not
    begin (each from an authenticated peer, in a frame whose MAC is right): the receiver counts it
    and drops that connection; a real transfer afterwards succeeds."""
    rx, dst, dest = make_receiver()
    client = _raw_connection(dest)
    if isinstance(garbage, bytes):
        client._conn.sock.sendall(garbage)
    else:
        client._conn.send(garbage, time.monotonic() + 5)  # framed and MAC'd, never checked against the schema
    assert _wait_for(lambda: rx.stats["garbage_messages"] == 1) and rx.stats["auth_refused"] == 0
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("ok", torch.arange(4), 1)
    send_part(tx, "ok", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("ok", TRAILER)]
    tx.close(), rx.close(), client.close()


def test_unknown_request_dropped_counted_then_serving_goes_on():
    """A part for an id nobody expects (or a cancelled one) is refused before any payload moves,
    and counted; the cache is untouched and the next transfer on the same connection succeeds."""
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("cancelled", torch.arange(4), 1)
    rx.cancel("cancelled")
    for rid in ("nobody", "cancelled"):
        with pytest.raises(TransferError, match="unknown"):
            send_part(tx, rid, dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert dst.abs().sum() == 0 and rx.stats["unknown_requests"] == 2
    assert rx.stats.get("bytes_received", 0) == 0
    rx.expect("ok", torch.arange(4), 1)
    send_part(tx, "ok", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("ok", TRAILER)] and tx.stats["groups_created"] == 1
    tx.close(), rx.close()


def test_token_count_mismatch_fails_request_not_connection():
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("r", torch.arange(5), 1)
    with pytest.raises(TransferError):
        send_part(tx, "r", dest, make_cache(), torch.arange(3), 0, HEADS).wait(10)
    assert [rid for rid, _ in poll_until(rx)[1]] == ["r"]
    tx.close(), rx.close()


def test_silent_sender_fails_transfer_after_timeout():
    """A sender that starts a part and goes quiet: the receiver fails the request after timeout_s."""
    rx, dst, dest = make_receiver(timeout_s=0.5)
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("r", torch.arange(4), 1)
    t = tx.begin("r", dest, 0, HEADS, 4)
    t.send_layer(0, flat(make_cache(), 0)[:, :4].clone())  # and never finish
    start = time.monotonic()
    done, failed = poll_until(rx, timeout=10)
    assert done == [] and failed[0][0] == "r" and "no KV" in failed[0][1]
    assert time.monotonic() - start < 5
    tx.close(), rx.close()


def _child_receiver(conn):
    rx = create_kv_transport("torch").receiver(COMPAT, make_cache(fill=0.0), 0, timeout_s=5)
    rx.expect("r1", torch.arange(4), 1)
    rx.expect("r2", torch.arange(4), 1)
    conn.send(rx.endpoint_address)
    time.sleep(60)


def test_dead_receiver_fails_transfer_and_group_is_rebuilt():
    """Kill the receiving process: the next transfer fails within the timeout, the group is
    dropped from the pool, and a new receiver at another address is served."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_receiver, args=(child,), daemon=True)
    proc.start()
    host, port = parent.recv()
    dest = KVEndpoint("d", 0, host, port)
    tx = create_kv_transport("torch").sender(COMPAT, "p0", timeout_s=2.0)
    send_part(tx, "r1", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    proc.kill()
    proc.join()
    start = time.monotonic()
    with pytest.raises(TransferError):
        send_part(tx, "r2", dest, make_cache(), torch.arange(4), 0, HEADS).wait(15)
    assert time.monotonic() - start < 10 and tx.num_groups == 0 and tx.stats["groups_failed"] == 1
    rx, _, dest2 = make_receiver()
    rx.expect("r3", torch.arange(4), 1)
    send_part(tx, "r3", dest2, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    tx.close(), rx.close()


def test_lru_pool_evicts_and_rebuilds_groups():
    """With room for one group, alternating between two receivers evicts and rebuilds; all succeed."""
    a, _, dest_a = make_receiver()
    b, _, dest_b = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0", max_groups=1)
    for i, (rx, dest) in enumerate([(a, dest_a), (b, dest_b), (a, dest_a)]):
        rx.expect(f"r{i}", torch.arange(4), 1)
        send_part(tx, f"r{i}", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert tx.num_groups == 1 and tx.stats["groups_evicted"] == 2 and tx.stats["groups_created"] == 3
    tx.close(), a.close(), b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_block_slots_take_the_block_copy_path(dtype):
    """Slots that fill whole blocks (in any block order, too many runs to receive straight into)
    plus a partial tail land exactly as the per-token reference scatter would put them."""
    compat = CompatRecord("tiny", str(dtype).removeprefix("torch."), LAYERS, HEADS, HEAD_DIM, block_size=BLOCK)
    dst = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    rx = create_kv_transport("torch").receiver(compat, dst, 0)
    dest = KVEndpoint("d", 0, *rx.endpoint_address)
    blocks = [5, 2, 9, 7, 0, 11][:MAX_DIRECT_RUNS + 1]
    slots = torch.cat([*(torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks),
                       torch.arange(13 * BLOCK, 13 * BLOCK + 2)])
    src = make_cache().to(dtype)
    tx = create_kv_transport("torch").sender(compat, "p0")
    ship_to_slots(tx, rx, dest, dst, src, slots)
    assert rx.stats["layers_scattered"] == LAYERS
    tx.close(), rx.close()


def test_a_parts_traceparent_crosses_the_control_channel():
    """A part's `begin` carries the sender's traceparent (engine/core/tracing.py): the completed request
    hands it over with when its first part began; a part without one hands over ""."""
    rx, _, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    src, trace = make_cache(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rx.expect("traced", torch.arange(4), 1)
    rx.expect("plain", torch.arange(4, 8), 1)
    before = time.time_ns()
    t = tx.begin("traced", dest, 0, HEADS, 4, trace=trace)
    for layer in range(LAYERS):
        t.send_layer(layer, flat(src, layer)[:, :4].clone())
    t.finish(TRAILER)
    t.wait(10)
    send_part(tx, "plain", dest, src, torch.arange(4), 0, HEADS).wait(10)
    traces = []
    assert sorted(poll_until(rx, 2, traces=traces)[0]) == [("plain", TRAILER), ("traced", TRAILER)]
    assert sorted(t for t, _ in traces) == ["", trace] and all(before <= ns <= time.time_ns() for _, ns in traces)
    tx.close()
    rx.close()
