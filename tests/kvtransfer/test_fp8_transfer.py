"""An fp8 KV cache over the KV transport: its bytes land exactly (data channel, received straight
into the cache or scattered, head slices of a TP mix, and the same-device transport), a quarter of
an fp32 cache's bytes for the same tokens; a peer whose cache dtype differs is refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer.base import IncompatiblePeerError
from kvtransfer.registry import create_kv_transport
from kvtransfer.params import KVEndpoint
from kvtransfer.receiver import MAX_DIRECT_RUNS
from kvtransfer.scatter import as_bytes, scatter_layer, slot_runs, whole_blocks
from tests.kvtransfer.test_torch_dist import (BLOCK, BLOCKS, COMPAT, HEAD_DIM, HEADS, LAYERS, TRAILER, flat,
                                              make_cache, make_receiver, poll_until, send_part, ship_to_slots)

pytestmark = pytest.mark.timeout(60)
FP8 = torch.float8_e4m3fn
COMPAT8 = dataclasses.replace(COMPAT, dtype="float8_e4m3fn")
SLOTS = {"one_run": torch.arange(BLOCK, 4 * BLOCK + 3),
         "scattered": torch.randperm(BLOCKS * BLOCK - BLOCK, generator=torch.Generator().manual_seed(0))[:40] + BLOCK}


def fp8_receiver(share_cache: bool = False):
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, HEAD_DIM, dtype=FP8)
    rx = create_kv_transport("torch").receiver(COMPAT8, cache, 0, timeout_s=5.0, share_cache=share_cache)
    host, port = rx.endpoint_address
    return rx, cache, KVEndpoint("d", 0, host, port)


@pytest.mark.parametrize("shared", [False, True], ids=["data_channel", "same_device"])
@pytest.mark.parametrize("slots", list(SLOTS), ids=list(SLOTS))
def test_fp8_bytes_land_exactly_at_a_quarter_of_fp32(slots, shared):
    """The decode cache's bytes at the reserved slots equal the prefill's fp8 bytes, zeros elsewhere
    (contiguous slots received in place, scattered ones past MAX_DIRECT_RUNS scattered, or written
    straight into a shared cache); bytes_sent is exactly 1/4 of an fp32 cache's for the same tokens."""
    slots = SLOTS[slots]
    src32 = make_cache()
    src8 = src32.to(FP8)  # e4m3, as the engine would store it with scale 1.0
    rx, dst, dest = fp8_receiver(share_cache=shared)
    tx = create_kv_transport("torch").sender(COMPAT8, "p0", same_device=shared)
    ship_to_slots(tx, rx, dest, dst, src8, slots)
    for layer in range(LAYERS):
        assert torch.equal(as_bytes(flat(dst, layer)[:, slots]), as_bytes(flat(src8, layer)[:, :len(slots)]))
    direct = shared or len(slot_runs(slots)) <= MAX_DIRECT_RUNS
    assert rx.stats["layers_direct" if direct else "layers_scattered"] == LAYERS
    assert (tx.stats.get("shared_connections", 0) == 1) == shared
    rx32, dst32, dest32 = make_receiver()
    tx32 = create_kv_transport("torch").sender(COMPAT, "p1")
    ship_to_slots(tx32, rx32, dest32, dst32, src32, slots)
    assert 4 * tx.stats["bytes_sent"] == tx32.stats["bytes_sent"] == LAYERS * 2 * len(slots) * HEADS * HEAD_DIM * 4
    for end in (tx, rx, tx32, rx32):
        end.close()


def test_fp8_head_halves_of_two_prefill_ranks_land_exactly():
    """Two prefill ranks each ship half the heads of the same tokens (a TP mix: the receiver
    scatters a slice of its heads): the decode cache holds every head's fp8 bytes."""
    rx, dst, dest = fp8_receiver()
    senders = [create_kv_transport("torch").sender(COMPAT8, f"p{p}") for p in range(2)]
    full, slots, half = make_cache().to(FP8), torch.arange(2 * BLOCK, 4 * BLOCK + 3), HEADS // 2
    rx.expect("r", slots, 2)
    for p, tx in enumerate(senders):
        send_part(tx, "r", dest, full, torch.arange(len(slots)), p * half, (p + 1) * half,
                  trailer=TRAILER if p == 0 else b"").wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    for layer in range(LAYERS):
        assert torch.equal(as_bytes(flat(dst, layer)[:, slots]), as_bytes(flat(full, layer)[:, :len(slots)]))
    for end in (*senders, rx):
        end.close()


@pytest.mark.parametrize("sender_dtype,receiver_dtype", [("float8_e4m3fn", "float32"), ("bfloat16", "float8_e4m3fn")])
def test_a_peer_of_another_kv_dtype_is_refused_by_name(sender_dtype, receiver_dtype):
    """An fp8 prefill and a full-precision decode (either way round) do not connect: the sender's
    wait names the dtype field and both values; nothing is written."""
    rx, dst, dest = make_receiver(compat=dataclasses.replace(COMPAT, dtype=receiver_dtype))
    rx.expect("r1", torch.arange(3), 1)
    tx = create_kv_transport("torch").sender(dataclasses.replace(COMPAT, dtype=sender_dtype), "p0")
    t = send_part(tx, "r1", dest, make_cache().to(getattr(torch, sender_dtype)), torch.arange(3), 0, HEADS)
    with pytest.raises(IncompatiblePeerError, match=rf"dtype: '{sender_dtype}' here vs '{receiver_dtype}'|"
                                                   rf"dtype: '{receiver_dtype}' here vs '{sender_dtype}'"):
        t.wait(10)
    assert rx.stats["refused_peers"] == 1 and dst.abs().sum() == 0
    tx.close(), rx.close()


@pytest.mark.parametrize("head_dim", [8, 3], ids=["word_rows", "odd_byte_rows"])
def test_scatter_layer_moves_fp8_bytes_like_the_per_token_reference(head_dim):
    """scatter_layer into an fp8 layer (whole blocks, then a tail token by token; rows of 4-byte
    words, or of bytes when a row is not a multiple of 4 bytes) equals per-token indexing."""
    blocks, block, heads = 8, 4, 1
    layer = torch.zeros(2, blocks, block, heads, head_dim, dtype=FP8)
    slots = torch.cat([torch.arange(5 * block, 6 * block), torch.arange(2 * block, 3 * block), torch.tensor([9, 30])])
    kv = torch.randn(2, len(slots), heads, head_dim).to(FP8)
    scatter_layer(layer, slots, whole_blocks(slots, block), kv, 0)
    want = torch.zeros_like(layer).view(torch.uint8).view(2, blocks * block, heads, head_dim)
    want[:, slots] = kv.view(torch.uint8)
    assert torch.equal(layer.view(torch.uint8).view(2, -1, heads, head_dim), want)
