"""The nixl KV transport, both ends in one process (two NIXL agents over UCX): the decode rank
reads each part from the prefill rank's registered pool, straight into its blocks or through a
staging slab, and the request's slots hold exactly the prefill's KV, whatever the TP sizes, block
sizes and block layouts of the two pools."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine.attention import BLOCK_LAYOUTS
from kvtransfer.base import KVPool, TransferError
from kvtransfer.control import ControlClient
from kvtransfer.nixl_agent import NixlError, nixl_unavailable, register
from kvtransfer.nixl_reads import PoolShape, plan_reads
from kvtransfer.nixl_wire import NIXL_SCHEMA
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.registry import create_kv_transport
from kvtransfer.scatter import gather_tokens
from tests.kvtransfer.test_torch_dist import Received

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))]
LAYERS, HEADS, HEAD_DIM = 3, 4, 8
TRAILER = b"\x07 what the request's KV comes with"


def compat(block_size: int = 4, checksum: bool = False) -> CompatRecord:
    return CompatRecord("tiny", "float32", LAYERS, HEADS, HEAD_DIM, block_size=block_size, kv_checksum=checksum)


def pool(heads: int, blocks: int = 16, block: int = 4, fill: float | None = None) -> torch.Tensor:
    shape = (LAYERS, 2, blocks, block, heads, HEAD_DIM)
    return torch.randn(shape) if fill is None else torch.full(shape, fill)


def tokens(cache: torch.Tensor, layout: str, layer: int, slots) -> torch.Tensor:
    """(2, tokens, heads, head_dim) of `slots`, read through the layout's views."""
    return gather_tokens(BLOCK_LAYOUTS[layout].views(cache[layer]), torch.as_tensor(slots), cache.shape[3])


def receiver(cache, head_offset=0, layout="torch", c=None, timeout_s=5.0):
    rx = create_kv_transport("nixl").receiver(c or compat(cache.shape[3]), cache, head_offset, timeout_s=timeout_s,
                                              layout=layout)
    return rx, KVEndpoint("d", 0, *rx.endpoint_address)


def sender(cache, head_offset=0, layout="torch", c=None, timeout_s=5.0):
    return create_kv_transport("nixl").sender(c or compat(cache.shape[3]), "p0", timeout_s=timeout_s,
                                              pool=KVPool(cache, layout, head_offset))


def ship(tx, rid, dest, src_slots, head_start, head_end, trailer=TRAILER):
    t = tx.begin(rid, dest, head_start, head_end, len(src_slots), torch.as_tensor(src_slots))
    for layer in range(LAYERS):
        t.layer_ready(layer)
    t.finish(trailer)
    return t


def poll_until(rx, n=1, timeout=10.0):
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < n and time.monotonic() < deadline:
        d, f = rx.poll()
        done, failed = done + [Received(c.request_id, c.trailer) for c in d], failed + f
        time.sleep(0.01)
    return done, failed


def assert_landed(src, src_layout, src_slots, src_lo, dst, dst_layout, dst_slots, dst_lo, n_heads):
    for layer in range(LAYERS):
        got = tokens(dst, dst_layout, layer, dst_slots)[:, :, dst_lo:dst_lo + n_heads]
        want = tokens(src, src_layout, layer, src_slots)[:, :, src_lo:src_lo + n_heads]
        assert torch.equal(got, want), layer


@pytest.mark.parametrize("layout", ["torch", "vllm_cpu"])
def test_whole_blocks_are_read_straight_into_the_decode_blocks(layout):
    """Same layout, block size and heads, tokens from a block's start: the decode's blocks are read
    into directly (no staging), every layer's KV equal, the trailer handed over; slots of other
    blocks untouched."""
    src, dst = pool(HEADS), pool(HEADS, fill=0.0)
    src_slots = [*range(8, 16), *range(28, 34)]  # blocks 2, 3, then 7 and half of 8
    dst_slots = [*range(40, 48), *range(4, 10)]  # blocks 10, 11, 1 and half of 2
    rx, dest = receiver(dst, layout=layout)
    tx = sender(src, layout=layout)
    rx.expect("r", torch.tensor(dst_slots), 1)
    ship(tx, "r", dest, src_slots, 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    assert_landed(src, layout, src_slots, 0, dst, layout, dst_slots, 0, HEADS)
    untouched = [s for s in range(64) if s // 4 not in (10, 11, 1, 2)]
    assert not tokens(dst, layout, 0, untouched).any()
    assert rx.stats["parts_read_direct"] == 1 and rx.stats.get("parts_read_staged", 0) == 0
    tx.close(), rx.close()


@pytest.mark.parametrize("src_layout,dst_layout", [("torch", "torch"), ("vllm_cpu", "torch"), ("torch", "vllm_cpu")])
def test_scattered_slots_other_layouts_and_block_sizes_go_through_staging(src_layout, dst_layout):
    """Tokens not starting a block, slots in no order, another block size or layout: the
    prefill's blocks are staged, then scattered; the KV is equal token by token."""
    src, dst = pool(HEADS, blocks=12, block=8), pool(HEADS, fill=0.0)
    src_slots = list(range(3, 23))  # from mid-block 0 to mid-block 2
    dst_slots = torch.randperm(64)[:20].tolist()
    rx, dest = receiver(dst, layout=dst_layout, c=compat(4))
    tx = sender(src, layout=src_layout, c=compat(8))
    rx.expect("r", torch.tensor(dst_slots), 1)
    ship(tx, "r", dest, src_slots, 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    assert_landed(src, src_layout, src_slots, 0, dst, dst_layout, dst_slots, 0, HEADS)
    assert rx.stats["parts_read_staged"] == 1
    tx.close(), rx.close()


def test_two_prefill_ranks_each_give_half_the_heads_of_one_decode_rank():
    """P2 -> D1: each prefill rank's pool holds two heads; the decode rank reads both parts into
    its four heads, and reports the request once, with the trailer rank 0's part carried."""
    full, dst = pool(HEADS), pool(HEADS, fill=0.0)
    halves = [full[..., :2, :].contiguous(), full[..., 2:, :].contiguous()]
    slots = list(range(16, 26))
    rx, dest = receiver(dst)
    txs = [sender(h, head_offset=2 * p) for p, h in enumerate(halves)]
    rx.expect("r", torch.tensor(slots), 2)
    for p, tx in enumerate(txs):
        ship(tx, "r", dest, slots, 2 * p, 2 * p + 2, trailer=TRAILER if p == 0 else b"").wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    assert_landed(full, "torch", slots, 0, dst, "torch", slots, 0, HEADS)
    for tx in txs:
        tx.close()
    rx.close()


def test_one_prefill_rank_gives_each_of_two_decode_ranks_its_heads():
    """P1 -> D2: each decode rank reads its two heads of the same tokens (staged: the pool keeps a
    token's heads together, so it reads all four and keeps two)."""
    src = pool(HEADS)
    dsts = [pool(2, fill=0.0), pool(2, fill=0.0)]
    slots = list(range(4, 16))
    tx = sender(src)
    for d, dst in enumerate(dsts):
        rx, dest = receiver(dst, head_offset=2 * d)
        rx.expect("r", torch.tensor(slots), 1)
        ship(tx, "r", dest, slots, 2 * d, 2 * d + 2).wait(10)
        assert poll_until(rx)[0] == [("r", TRAILER)]
        assert_landed(src, "torch", slots, 2 * d, dst, "torch", slots, 0, 2)
        rx.close()
    tx.close()


@pytest.mark.parametrize("direct", [True, False])
def test_checksums_cover_what_was_read(direct):
    """kv_checksum: the sender's checksum of its pool and the receiver's of what landed agree."""
    src, dst = pool(HEADS), pool(HEADS, fill=0.0)
    slots = list(range(8, 20)) if direct else [5, 9, 2, 33, 34, 35]
    c = compat(4, checksum=True)
    rx, dest = receiver(dst, c=c)
    tx = sender(src, c=c)
    rx.expect("r", torch.tensor(slots), 1)
    ship(tx, "r", dest, slots, 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    assert rx.stats.get("kv_checksum_mismatches", 0) == 0
    tx.close(), rx.close()


def test_a_part_whose_done_never_comes_fails_at_its_deadline_and_frees_nothing_early():
    """A lost completion: every layer announced, `done` never sent. The receiver fails the request
    once it has been silent for its deadline; the sender's part is not acknowledged."""
    src, dst = pool(HEADS), pool(HEADS, fill=0.0)
    rx, dest = receiver(dst, timeout_s=1.0)
    tx = sender(src)
    rx.expect("r", torch.arange(4, 8), 1)
    t = tx.begin("r", dest, 0, HEADS, 4, torch.arange(4, 8))
    for layer in range(LAYERS):
        t.layer_ready(layer)
    done, failed = poll_until(rx, timeout=10)
    assert done == [] and failed and failed[0][0] == "r" and "no KV" in failed[0][1]
    with pytest.raises(TransferError):
        t.wait(0.2)
    tx.close(), rx.close()


def test_a_cancelled_request_reads_nothing_into_its_slots():
    src, dst = pool(HEADS), pool(HEADS, fill=0.0)
    rx, dest = receiver(dst)
    tx = sender(src)
    rx.expect("r", torch.arange(0, 8), 1)
    rx.cancel("r")
    t = ship(tx, "r", dest, list(range(8)), 0, HEADS)
    with pytest.raises(TransferError, match="unknown or cancelled"):
        t.wait(10)
    assert not dst.any()
    tx.close(), rx.close()


def test_a_receiver_with_another_secret_never_sees_the_agent_metadata(monkeypatch):
    """The pool's keys travel in the hello, after the handshake: a receiver that cannot prove the
    cluster secret gets no hello, so it cannot read the pool; the part fails."""
    from kvtransfer.wire import SECRET_ENV
    monkeypatch.setenv(SECRET_ENV, "a-stranger-who-guessed-wrong-0123456789")
    stranger_cache = pool(HEADS, fill=0.0)
    stranger, dest = receiver(stranger_cache)
    monkeypatch.setenv(SECRET_ENV, "kvtransfer-tests-secret-0123456789abcdef")
    tx = sender(pool(HEADS))
    t = ship(tx, "r", dest, list(range(4)), 0, HEADS)
    with pytest.raises(TransferError):
        t.wait(10)
    deadline = time.monotonic() + 10
    while stranger.stats["auth_refused"] < 1 and time.monotonic() < deadline:  # counted on the server's thread
        time.sleep(0.01)
    assert stranger.stats["auth_refused"] >= 1 and stranger.stats.get("connections", 0) == 0
    assert tx.stats["groups_failed"] >= 1 and tx.stats.get("groups_created", 0) == 0
    tx.close(), stranger.close()


def test_a_hello_with_a_malformed_pool_is_refused():
    dst = pool(HEADS, fill=0.0)
    rx, dest = receiver(dst)
    tx = sender(pool(HEADS))
    client = ControlClient(dest.address, NIXL_SCHEMA)
    bad = tx.shape.to_dict() | {"layout": "someone-elses"}
    welcome = client.call({"kind": "hello", "sender_id": "x", "compat": compat().to_dict(), "agent": tx.metadata,
                           "pool": bad}, 5)
    assert not welcome["ok"] and "layout" in welcome["error"] and rx.stats["refused_peers"] == 1
    client.close(), tx.close(), rx.close()


def test_a_failed_registration_names_the_locked_memory_limit():
    class Refusing:
        def register_memory(self, tensor):
            raise RuntimeError("NIXL_ERR_BACKEND")
    with pytest.raises(NixlError, match=r"ulimit -l.*at least 64 KiB"):
        register(Refusing(), torch.zeros(1 << 16, dtype=torch.uint8))


def test_read_plans_merge_consecutive_blocks_into_one_range_per_plane():
    """Direct: blocks consecutive on both sides are one descriptor per plane (torch layout) or one
    (block-contiguous layout); staged: every touched prefill block once."""
    src = PoolShape("torch", 1000, 0, "DRAM", LAYERS, 16, 4, HEADS, 0, HEAD_DIM, 4)
    dst = PoolShape("torch", 5000, 0, "DRAM", LAYERS, 32, 4, HEADS, 0, HEAD_DIM, 4)
    plan = plan_reads(src, np.arange(8, 22), dst, np.r_[np.arange(40, 48), np.arange(4, 10)], 0, HEADS)
    assert plan.direct and plan.runs.tolist() == [[2, 10, 2], [4, 1, 2]]
    local, remote = plan.ranges(src, dst, [src.addr], [dst.addr])
    block = 4 * HEADS * HEAD_DIM * 4  # a block's keys (or values): 512 bytes
    assert len(local) == 4 and remote[:, 1].tolist() == [2 * block] * 4
    assert remote[1, 0] == 1000 + (16 + 2) * block and local[1, 0] == 5000 + (32 + 10) * block  # values of blocks 2, 10
    staged = plan_reads(src, np.array([13, 5, 6, 14]), dst, np.array([0, 1, 2, 3]), 0, HEADS)
    assert not staged.direct and staged.staging_blocks == 2 and staged.local_slots.tolist() == [5, 1, 2, 6]


def test_a_prefill_agent_idles_without_spinning_a_core():
    """A prefill rank's agent runs UCX's progress thread with a delay between passes (nixl_agent.py):
    idle for 2 s, its process uses a small part of a core (NIXL's own 0 us delay spins one: 2.5 s of
    CPU in 3 s, measured on the project's 2-core host)."""
    import subprocess
    import sys
    code = ("import resource, time\n"
            "from kvtransfer.nixl_agent import make_agent\n"
            "agent = make_agent('prefill', progress=True)\n"
            "time.sleep(0.3)\n"
            "r0 = resource.getrusage(resource.RUSAGE_SELF); time.sleep(2.0); r1 = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert float(run.stdout.strip().splitlines()[-1]) < 0.4, run.stdout


def test_a_parts_traceparent_crosses_the_control_channel():
    """As torch's: the `begin` of a part read with NIXL carries the sender's traceparent to the receiver."""
    src, dst = pool(HEADS), pool(HEADS, fill=0.0)
    rx, dest = receiver(dst)
    tx = sender(src)
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rx.expect("r", torch.arange(8), 1)
    t = tx.begin("r", dest, 0, HEADS, 8, torch.arange(8), trace=trace)
    for layer in range(LAYERS):
        t.layer_ready(layer)
    t.finish(TRAILER)
    t.wait(10)
    deadline, done = time.monotonic() + 10, []
    while not done and time.monotonic() < deadline:
        done = rx.poll()[0]
        time.sleep(0.01)
    assert [(c.request_id, c.trace) for c in done] == [("r", trace)] and done[0].began_ns > 0
    tx.close()
    rx.close()
