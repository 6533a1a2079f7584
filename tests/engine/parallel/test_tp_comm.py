"""Broadcasting a step to TP followers (engine/parallel/tp_comm.py): the structure travels as msgpack on the
control group (engine/parallel/tp_wire.py), the tensors as one buffer per dtype on the device group; every follower gets a
step equal to the driver's, field by field, tensors included (gloo for both groups here)."""
from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.base import AttentionMetadata
from engine.parallel.layers import TPGroup
from engine.parallel.step import ModelInput
from engine.parallel.tp_comm import fill_tensors, split_tensors
from kvtransfer.connector import Shipment
from kvtransfer.params import KVEndpoint, KVTransferParams

pytestmark = pytest.mark.timeout(120)
STEP_TYPES = (Shipment, KVTransferParams, KVEndpoint)  # the prefill step's records from kvtransfer


def make_step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    meta = AttentionMetadata(num_decodes=1, query_lens=[1, 3], seq_lens_cpu=[5, 3],
                             query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([5, 3], dtype=torch.int32),
                             block_tables=torch.randint(0, 9, (2, 4), generator=g, dtype=torch.int32),
                             slot_mapping=torch.randint(0, 99, (4,), generator=g), block_size=4)
    inp = ModelInput(torch.randint(0, 50, (4,), generator=g), torch.tensor([4, 0, 1, 2]), (meta,),
                     torch.tensor([0, 3]), ["a", "b"])
    params = KVTransferParams("b", "decode-0", 1, (KVEndpoint("decode-0", 0, "10.0.0.9", 7000),))
    return inp, [Shipment("b", params, 3, torch.tensor([8, 9, 10]))]


def assert_equal_steps(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_equal_steps(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_steps(x, y)
    else:
        assert a == b


def test_split_then_fill_gives_the_step_back():
    """Tensors leave the structure (slots in their place) and come back as views of one buffer
    per dtype, equal to the originals."""
    step = make_step()
    skeleton, tensors = split_tensors(step, "cpu")
    assert len(tensors) == 8 and not any(isinstance(v, torch.Tensor) for v in dataclasses.astuple(skeleton[0].meta))
    buffers = {}
    for t in tensors:
        buffers.setdefault(t.dtype, []).append(t.reshape(-1))
    assert_equal_steps(fill_tensors(skeleton, {d: torch.cat(p) for d, p in buffers.items()}), step)


def _rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    control = dist.new_group(backend="gloo")
    tp = TPGroup(rank, 3, dist.group.WORLD, control, key=b"k" * 32, wire_types=STEP_TYPES)
    got = [tp.broadcast_step(make_step(seed=s) if rank == 0 else None) for s in range(3)]
    got.append(tp.broadcast_step("stop" if rank == 0 else None))
    if rank:
        for s in range(3):
            assert_equal_steps(got[s], make_step(seed=s))
        assert got[3] == "stop"
    out.put(rank)
    dist.destroy_process_group()


def test_followers_get_the_drivers_steps():
    """Three ranks in their own processes: each follower's steps equal the driver's, then "stop"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    assert sorted(out.get(timeout=90) for _ in procs) == [0, 1, 2]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
