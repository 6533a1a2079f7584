"""The TP group's control messages (engine/parallel/tp_wire.py): msgpack of registered records only, sealed
with an HMAC; nothing that crosses a 2-rank group is unpickled, and a tampered or foreign message
is refused before it is decoded."""
from __future__ import annotations

import dataclasses
import pickle
import socket
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

from engine.parallel.layers import TPGroup
from engine.parallel.step import engine_types
from engine.parallel.tp_wire import TPAuthError, WireCodec
from tests.engine.parallel.test_tp_comm import STEP_TYPES, assert_equal_steps, make_step

pytestmark = pytest.mark.timeout(400)  # spawned ranks: slow on a loaded 2-core box
KEY = b"k" * 32


@dataclasses.dataclass
class NotRegistered:
    command: str = "touch /tmp/pwned"


def codec() -> WireCodec:
    return WireCodec(engine_types() + STEP_TYPES)


def test_a_step_and_a_poll_round_trip_with_their_types():
    """decode(encode(x)) == x for a prefill step (dataclasses, tuples, lists, CPU tensors of
    several dtypes) and a decode rank's poll (transfer ids, (id, why) pairs)."""
    c = codec()
    step = make_step()
    assert_equal_steps(c.decode(c.encode(step)), step)
    poll = (["a", "c#kv1"], [("b", "timed out")])  # the transfers complete and failed on one rank
    assert c.decode(c.encode(poll)) == poll
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert torch.equal(c.decode(c.encode(x)), x) and c.decode(c.encode(torch.float16)) is torch.float16


def test_only_registered_records_cross():
    """An unregistered dataclass cannot be sent, and a message naming one (or a callable such as
    os.system) is refused on receipt: nothing but registered types is ever constructed."""
    c = codec()
    with pytest.raises(TypeError, match="not a type allowed"):
        c.encode(NotRegistered())
    for name in (f"{__name__}.NotRegistered", "os.system", "builtins.eval"):
        forged = msgpack.packb(msgpack.ExtType(2, msgpack.packb([name, {"command": "x"}])))
        with pytest.raises(ValueError, match="not a type allowed"):
            c.decode(forged)
    with pytest.raises(ValueError, match="not a torch dtype"):
        c.decode(msgpack.packb(msgpack.ExtType(3, b"Tensor")))


def _record_unpickling(calls: list) -> None:
    """Every unpickling path of this process (pickle.loads, pickle.Unpickler, torch.distributed's
    own alias of it) records its call, then refuses."""
    def loads(*a, **k):
        calls.append("loads")
        raise AssertionError("unpickled")

    class Unpickler(pickle.Unpickler):
        def load(self):
            calls.append("Unpickler")
            raise AssertionError("unpickled")

    pickle.loads, pickle.Unpickler, c10d._unpickler = loads, Unpickler, Unpickler


def _rank(rank: int, port: int, out) -> None:
    calls: list[str] = []
    _record_unpickling(calls)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=280))
    tp = TPGroup(rank, 2, dist.group.WORLD, key=KEY, wire_types=STEP_TYPES)
    steps = [tp.broadcast_step(make_step(seed=s) if rank == 0 else None) for s in range(2)]
    choice = tp.broadcast_object({"expanded": 1.5} if rank == 0 else None)
    polls = tp.all_gather_object(([f"r{rank}"], [(f"f{rank}", "timed out")]))
    refused = []
    decoded = []
    tp.channel.codec.decode = lambda data: decoded.append(data)  # nothing refused may reach it
    real_seal = tp.channel._seal
    tp.channel._seal = lambda obj, seq: bytes([real_seal(obj, seq)[0] ^ 1]) + real_seal(obj, seq)[1:]
    try:
        tp.broadcast_step("stop" if rank == 0 else None)  # tampered: one bit of the payload flipped
    except TPAuthError:
        refused.append("tampered")
    tp.channel._seal = real_seal
    if rank == 0:
        tp.channel.key = b"f" * 32  # a foreign sender: another key
    try:
        tp.all_gather_object("poll")
    except TPAuthError:
        refused.append("foreign")
    out.put((rank, calls, refused, decoded, tp.channel.num_refused, rank == 0 or (
        all(assert_equal_steps(got, make_step(seed=s)) is None for s, got in enumerate(steps))
        and choice == {"expanded": 1.5}
        and polls == [(["r0"], [("f0", "timed out")]), (["r1"], [("f1", "timed out")])])))
    dist.destroy_process_group()


def test_two_ranks_exchange_steps_without_unpickling_and_refuse_forged_messages():
    """Two gloo ranks in their own processes, with every unpickling path recording: steps,
    a load-time choice and KV polls cross and arrive equal, and nothing is unpickled. A message
    with one bit flipped (rank 1 refuses it) and one sealed under another key (each rank refuses
    the other's) raise TPAuthError, are counted, and never reach the decoder."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    (_, calls0, refused0, decoded0, n0, _), (_, calls1, refused1, decoded1, n1, equal1) = results
    assert calls0 == calls1 == []
    assert equal1
    assert refused0 == ["foreign"] and refused1 == ["tampered", "foreign"]
    assert (n0, n1) == (1, 2) and decoded0 == decoded1 == []
