"""The decode side of the `nixl` KV transport: it reads each part from the prefill rank's pool.

The torch transport's receiver (receiver.py: requests expected, cancelled, completed or failed;
deadlines; the authenticated control server) with the messages of nixl_wire.py. At the hello the
sender's NIXL agent is added (only a connection that proved the cluster secret gets that far) and
its pool's shape checked; at `begin` the part's reads are planned (nixl_reads.py: straight into
this cache, or through a staging slab); each `layer` posts the reads of the layers it names, which
the session's writer thread waits for (its deadline) and, staged, scatters into the request's
slots; `done` is acked once all of them landed, so the sender frees its blocks only then.

A direct read into the request's slots counts as a receive in flight (receiver.py: a cancel waits
for it, at most its deadline, past which it is aborted); a read past its deadline, or from a peer
that died, fails the part and drops the connection (its in-flight reads aborted first). The
remote agent is removed when its last connection ends.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from engine.attention import BLOCK_LAYOUTS
from engine.core.threads import run_serially
from kvtransfer.channel import ChannelError
from kvtransfer.control import ControlGarbage
from kvtransfer.nixl_agent import make_agent, register
from kvtransfer.nixl_reads import PoolShape, plan_reads, runs_to_slots
from kvtransfer.nixl_reads_channel import NixlReads
from kvtransfer.nixl_wire import NIXL_SCHEMA, decode_runs
from kvtransfer.params import CompatRecord
from kvtransfer.receiver import TorchDistReceiver
from kvtransfer.scatter import gather_tokens
from kvtransfer.session import RECEIVE_DEPTH, Expected, Part, Session
from kvtransfer.wire import PartChecksum, WireError

logger = logging.getLogger(__name__)


class NixlSession(Session):
    """One prefill rank's connection: its announced layers are read, not received."""

    def _layer(self, msg: dict, part: Part) -> None:
        first, count = msg["layer"], msg["count"]
        if not (0 <= first and 0 < count and first + count <= self.rx.compat.num_layers):
            raise ControlGarbage(f"layers {first} + {count} of {self.rx.compat.num_layers}")
        plan, rid = part.reads, msg["request_id"]
        if plan.direct:
            i = self._next_write()
            e = self.rx.start_receiving(rid)
            try:  # a cancelled request's layers are not read at all
                posted = None if e is None else self.channel.read(plan, range(first, first + count), None,
                                                                  self.rx.kv_cache)
            except ChannelError as exc:
                self.rx.on_received(rid, part, e, 0, 0)
                self._payload_failed(msg, exc)
            self.writes[i] = self.writer.submit(self._landed, msg, part, e, posted)
            return
        for layer in range(first, first + count):
            i = self._next_write()  # its staging slab is free again
            try:
                staging = self.channel.stage(i, plan)
                posted = self.channel.read(plan, range(layer, layer + 1), staging, self.rx.kv_cache)
            except ChannelError as exc:
                self._payload_failed(msg, exc)
            self.writes[i] = self.writer.submit(self._staged, msg, layer, part, posted, staging)

    def _landed(self, msg: dict, part: Part, e: Expected | None, posted) -> None:
        """On the writer thread: the layers read straight into the request's slots landed (or
        failed: the connection is dropped); then the slots are released to cancel()."""
        error, num_bytes = None, 0
        if posted is not None:
            handle, num_bytes = posted
            try:
                self.channel.wait(handle, self.rx.timeout_s)
            except ChannelError as exc:
                error = exc
        if error is None and e is not None and part.hashed:  # before cancel() may free them
            for layer in range(msg["layer"], msg["layer"] + msg["count"]):
                part.hash(self.rx.read_back(layer, e.slots, part))
        self.rx.count("bytes_read", num_bytes)
        self.rx.on_received(msg["request_id"], part, e, msg["count"] if error is None else 0, num_bytes)
        if error is not None:
            self._payload_failed(msg, error)
        self.activity = time.monotonic()

    def _staged(self, msg: dict, layer: int, part: Part, posted, staging: torch.Tensor) -> None:
        """On the writer thread: once the layer's blocks are in the staging slab, the part's heads
        of its tokens go into the request's slots."""
        handle, num_bytes = posted
        try:
            self.channel.wait(handle, self.rx.timeout_s)
        except ChannelError as exc:
            self._payload_failed(msg, exc)
        self.activity = time.monotonic()
        self.rx.count("bytes_read", num_bytes)
        src, plan = self.channel.src, part.reads
        slab = staging.view(self.rx.kv_cache.dtype).view(2, plan.staging_blocks, src.block_size, src.num_heads,
                                                         src.head_dim)
        kv = gather_tokens(BLOCK_LAYOUTS[src.layout].views(slab), plan.local_slots, src.block_size)
        lo = msg["head_start"] - src.head_offset
        kv = kv[:, :, lo:lo + part.num_heads].contiguous()
        part.hash(kv)
        self.rx.write_part(self, msg["request_id"], layer, part, kv.view(-1).view(torch.uint8))

    def close(self) -> None:
        super().close()
        if self.channel is not None:
            self.channel.free_staging()


class NixlReceiver(TorchDistReceiver):
    schema = NIXL_SCHEMA

    def __init__(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int, host: str = "127.0.0.1",
                 timeout_s: float = 10.0, kv_views=None, layout: str = "torch"):
        """`layout`: how this cache's blocks lie (engine/attention BLOCK_LAYOUTS; `kv_views` its views)."""
        self.agent = make_agent("decode", progress=False)  # it only reads: its waits progress it
        self._registered = register(self.agent, kv_cache)
        self.shape = PoolShape.of(kv_cache, layout, head_offset)
        self._remotes: Counter = Counter()  # prefill agents added -> connections using them
        if kv_views is None and layout != "torch":  # what write_part scatters through
            kv_views = BLOCK_LAYOUTS[layout].views
        super().__init__(compat, kv_cache, head_offset, host, timeout_s, share_cache=False, kv_views=kv_views)

    def _open_session(self, drop, session_key: bytes | None) -> Session:
        run_serially()  # as receiver.py's: its writer scatters with no OpenMP team of its own
        return NixlSession(self, drop)  # no payload MAC: nothing crosses a data channel

    def on_hello(self, session: Session, msg: dict) -> dict:
        reply = {"kind": "welcome", "ok": False, "error": None, "compat": self.compat.to_dict()}
        session.sender_id = msg["sender_id"]
        try:
            reply["error"] = self.compat.mismatch(CompatRecord.from_dict(msg["compat"]))
            src = PoolShape.from_dict(msg["pool"])
            if (src.head_dim, src.itemsize, src.num_slabs) != (self.shape.head_dim, self.shape.itemsize,
                                                               self.compat.num_layers):
                raise ValueError(f"its pool of {src.num_slabs} slabs of {src.head_dim}-wide heads of "
                                 f"{src.itemsize} bytes is not this transfer's")
        except ValueError as exc:
            reply["error"] = reply["error"] or f"malformed hello: {exc}"
        if reply["error"] is None:
            try:
                remote = self.agent.add_remote_agent(msg["agent"])
                remote = remote.decode() if isinstance(remote, bytes) else remote
            except Exception as exc:
                reply["error"] = f"its NIXL agent metadata was refused: {type(exc).__name__}: {str(exc)[:160]}"
        with self._lock:
            if reply["error"] is not None:
                logger.warning("refused KV sender %s: %s", session.sender_id, reply["error"])
                self._stats["refused_peers"] += 1
                return reply
            self._remotes[remote] += 1
            self._stats["connections"] += 1
            session.index = self._stats["connections"]
            self._sessions.add(session)
        session.data_channel = "nixl"
        session.channel = NixlReads(self.agent, remote, src, self.shape, self.kv_cache.device, RECEIVE_DEPTH)
        reply["ok"] = True
        return reply

    def on_begin(self, session: Session, msg: dict) -> dict:
        rid, lo = msg["request_id"], msg["head_start"] - self.head_offset
        reply = {"kind": "ready", "request_id": rid, "ok": False, "error": None}
        n_heads, src = msg["head_end"] - msg["head_start"], session.channel.src
        if not (0 <= lo and 0 < n_heads and lo + n_heads <= self.num_local_heads and msg["num_tokens"] > 0) or \
                not src.head_offset <= msg["head_start"] < msg["head_end"] <= src.head_offset + src.num_heads:
            raise ControlGarbage(f"begin does not fit this rank or its sender: {msg}")
        try:
            src_slots = runs_to_slots(decode_runs(msg["source"], msg["num_tokens"]))
        except WireError as exc:
            raise ControlGarbage(str(exc)) from None
        if src_slots.max() >= src.num_blocks * src.block_size:
            raise ControlGarbage(f"begin.source names slots past the sender's pool of {src.num_blocks} blocks")
        with self._lock:
            if (e := self._begun(msg, reply)) is not None:
                part = Part(lo, n_heads, msg["num_tokens"], [],
                            checksum=PartChecksum() if self.compat.kv_checksum else None,
                            reads=plan_reads(src, src_slots, self.shape, e.host_slots.numpy(), msg["head_start"],
                                             msg["head_end"]))
                self._stats["parts_read_direct" if part.reads.direct else "parts_read_staged"] += 1
                session.parts[(rid, msg["head_start"])] = part
                e.sessions.add(session)
                e.last_activity = time.monotonic()
                reply["ok"] = True
        return reply

    def read_back(self, layer: int, slots: torch.Tensor, part: Part) -> torch.Tensor:
        """(2, tokens, part heads, head_dim) of `slots` of this cache: what a checksum covers."""
        views = BLOCK_LAYOUTS[self.shape.layout].views(self.kv_cache[layer])
        return gather_tokens(views, slots, self.block_size)[:, :, part.lo:part.lo + part.num_heads]

    def on_session_closed(self, session: Session) -> None:
        super().on_session_closed(session)
        reads = session.channel
        if reads is None:
            return
        with self._lock:
            self._remotes[reads.remote] -= 1
            last = self._remotes[reads.remote] <= 0
            if last:
                del self._remotes[reads.remote]
        if last:
            try:
                self.agent.remove_remote_agent(reads.remote)
            except Exception as exc:
                logger.debug("NIXL remote agent %s: %s", reads.remote, exc)

    def close(self) -> None:
        super().close()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:
            logger.debug("NIXL deregistration: %s", exc)
