"""The decode side of the KV connector's transport.

A control server (control.py) accepts one connection per prefill rank; each gets a `_Session`
that answers its messages (wire.py) in order and owns its data channel (channel.py):

    hello -> compat checked -> welcome          join  -> data channel built
    begin -> the request's slots are reserved here? -> ready (ok, or why not; the runs)
    layer -> receive exactly that payload (deadline): straight into the cache when the part has
             all of this rank's heads and its slots form at most MAX_DIRECT_RUNS stretches,
             else into a buffer, then scattered into the request's slots
    done  -> all layers there? -> ack;  every part of the request done -> poll() reports it

Requests are tracked in `_Expected`: expect(rid, slots, num_parts) ... poll() reports
(rid, first_token, logprobs), or a failure: a begun part silent for timeout_s (unless its
connection is busy with other requests' KV), a connection lost mid-part, a part of the wrong
size. A garbage message or a receive past its deadline drops its connection (the sender
rebuilds it); payloads of a cancelled request are received and dropped. All of it is counted.
A cancel waits for a receive in flight into the request's slots (at most its deadline), so no
byte lands in blocks that may have moved on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer import wire
from kvtransfer.base import CompletedTransfer, KVReceiver
from kvtransfer.channel import RECEIVER, ChannelError, DataChannel, open_channel
from kvtransfer.control import ControlError, ControlGarbage, ControlServer
from kvtransfer.params import CompatRecord
from kvtransfer.scatter import scatter_layer, slot_runs, whole_blocks

logger = logging.getLogger(__name__)
# Each run costs two messages per layer (K, V); beyond this many, one message and a scatter is faster.
MAX_DIRECT_RUNS = 4


@dataclass
class _Expected:
    slots: torch.Tensor  # (num_tokens,) int64
    num_parts: int
    block_ids: torch.Tensor | None  # (num_tokens // block_size,) when the slots fill whole blocks in order
    runs: list[tuple[int, int, int]]  # slot_runs(slots)
    sessions: set = field(default_factory=set)  # the connections its parts arrive on
    parts_done: int = 0
    first_token: int = -1
    logprobs: dict[int, float] | None = None
    last_activity: float | None = None  # set when its first part begins
    receiving: int = 0  # receives in flight straight into its slots


@dataclass
class _Part:
    lo: int  # first local head
    num_heads: int
    num_tokens: int
    runs: list[tuple[int, int, int]]  # received straight into the cache; [] to scatter
    layers: int = 0


class _Session:
    """One prefill rank's connection: its messages, in order, on the connection's thread."""

    def __init__(self, rx: TorchDistReceiver, drop):
        self.rx, self.drop = rx, drop
        self.sender_id, self.index = "?", None
        self.channel: DataChannel | None = None
        self.parts: dict[tuple[str, int], _Part] = {}  # (request id, head_start) -> begun, not done
        self.activity = time.monotonic()
        # two receive buffers: layer i+1 arrives in one while the writer thread scatters layer i from the other
        self.buffers = [torch.empty(0, dtype=torch.uint8, device=rx.kv_cache.device) for _ in range(2)]
        self.writes: list[Future | None] = [None, None]
        self.next_buffer = 0
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write")

    def __call__(self, msg: dict) -> dict | None:
        self.activity = time.monotonic()
        kind = msg["kind"]
        if kind == "hello" and self.index is None:
            return self.rx._hello(self, msg)
        if kind == "join" and self.index is not None and self.channel is None and msg["channel"] == self.index:
            self.channel = self.rx._open(self.index)
            return None
        if self.channel is None or kind not in ("begin", "layer", "done"):
            raise ControlGarbage(f"{kind} message out of order")
        if kind == "begin":
            return self.rx._begin(self, msg)
        part = self.parts.get((msg["request_id"], msg["head_start"]))
        if part is None:
            raise ControlGarbage(f"{kind} for a part that did not begin: {msg['request_id']}")
        if kind == "layer":
            return self._layer(msg, part)
        self._written()
        del self.parts[(msg["request_id"], msg["head_start"])]
        return self.rx._done(self, msg, part)

    def _layer(self, msg: dict, part: _Part) -> None:
        """The announced layers arrive while the ones before are written (or still arriving, when
        received straight into the cache)."""
        first, count = msg["layer"], msg["count"]
        if not (0 <= first and 0 < count and first + count <= self.rx.compat.num_layers):
            raise ControlGarbage(f"layers {first} + {count} of {self.rx.compat.num_layers}")
        if part.runs:
            i = self._next_write()
            self.writes[i] = self.writer.submit(self._land, msg, part, *self._post_direct(msg, part))
            return
        n = wire.payload_bytes(part.num_tokens, part.num_heads, self.rx.compat.head_dim, self.rx.kv_cache.dtype)
        for layer in range(first, first + count):
            i = self._next_write()  # its buffer is free again
            if self.buffers[i].numel() < n:
                self.buffers[i] = torch.empty(n, dtype=torch.uint8, device=self.buffers[i].device)
            try:
                handle = self.channel.irecv(self.buffers[i][:n])
            except Exception as exc:  # an aborted channel refuses new operations
                self.channel.close()
                self._payload_failed(msg, ChannelError(f"KV receive could not be posted: {str(exc)[:200]}"))
            self.writes[i] = self.writer.submit(self._scatter, msg, layer, part, handle, self.buffers[i][:n])

    def _scatter(self, msg: dict, layer: int, part: _Part, handle, payload: torch.Tensor) -> None:
        """On the writer thread: once the layer is in the buffer, into the request's slots."""
        try:
            self.channel.wait(handle, self.rx.timeout_s)
        except ChannelError as exc:  # the pair is aborted (the channel already is); the sender rebuilds it
            self._payload_failed(msg, exc)
        self.activity = time.monotonic()
        self.rx._write(self, msg["request_id"], layer, part, payload)

    def _next_write(self) -> int:
        """The write slot to use next, once the write it held before is done."""
        i = self.next_buffer
        self.next_buffer = 1 - i
        self._written(i)
        return i

    def _post_direct(self, msg: dict, part: _Part) -> tuple:
        """Posts receives of the layers' K and V of each run straight into the request's slots (or,
        if it was cancelled, into a buffer that is dropped). Returns (its _Expected, handles, error)."""
        e = self.rx._receiving(msg["request_id"])
        handles, error = [], None
        try:  # all posted at once: the sender's posted sends meet them without a round trip each
            for layer in range(msg["layer"], msg["layer"] + msg["count"]):
                cache = self.rx.kv_cache[layer].view(2, self.rx.num_slots, -1)  # (2, slots, heads * head_dim)
                for _, length, slot in part.runs:
                    dsts = cache[:, slot:slot + length] if e is not None else torch.empty_like(cache[:, :length])
                    handles += [self.channel.irecv(dst.view(torch.uint8)) for dst in dsts]
        except Exception as exc:  # an aborted channel refuses new operations
            self.channel.close()
            error = ChannelError(f"KV receive could not be posted: {str(exc)[:200]}")
        return e, handles, error

    def _land(self, msg: dict, part: _Part, e: _Expected | None, handles: list, error: Exception | None) -> None:
        """On the writer thread: waits for every posted receive to end (after a failure the channel
        is aborted: at once), then releases the request's slots to cancel()."""
        for handle in handles:
            try:
                self.channel.wait(handle, self.rx.timeout_s)
            except ChannelError as exc:
                error = error or exc
        num_bytes = msg["count"] * wire.payload_bytes(part.num_tokens, part.num_heads, self.rx.compat.head_dim,
                                                      self.rx.kv_cache.dtype)
        self.rx._received(msg["request_id"], part, e, msg["count"] if error is None else 0, num_bytes)
        if error is not None:
            self._payload_failed(msg, error)
        self.activity = time.monotonic()

    def _payload_failed(self, msg: dict, exc: Exception):
        self.rx._count("payload_failures")
        logger.warning("KV from %s: payload of %s layer %d: %s", self.sender_id, msg["request_id"], msg["layer"], exc)
        raise ControlError(str(exc)) from None

    def _written(self, i: int | None = None) -> None:
        """Waits for the write from buffer `i` (None: both) to finish; its error is this session's."""
        for k in (0, 1) if i is None else (i,):
            if self.writes[k] is not None:
                self.writes[k], future = None, self.writes[k]
                future.result()

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        if self.channel is not None:
            self.channel.close()
        self.rx._closed_session(self)


class TorchDistReceiver(KVReceiver):
    def __init__(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int, host: str = "127.0.0.1",
                 timeout_s: float = 10.0):
        # kv_cache: (num_layers, 2, num_blocks, block_size, local_kv_heads, head_dim)
        assert kv_cache.dim() == 6 and kv_cache.shape[0] == compat.num_layers, kv_cache.shape
        self.compat, self.kv_cache, self.head_offset = compat, kv_cache, head_offset
        self.num_local_heads, self.timeout_s, self.host = kv_cache.shape[4], timeout_s, host
        self.block_size = kv_cache.shape[3]
        self.num_slots = kv_cache.shape[2] * self.block_size
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        self._lock = threading.Lock()
        self._receives_done = threading.Condition(self._lock)
        self._expected: dict[str, _Expected] = {}
        self._completed: list[CompletedTransfer] = []
        self._failed: list[tuple[str, str]] = []
        self._stats: Counter = Counter()
        self._sessions: set[_Session] = set()
        self._control = ControlServer(host, lambda drop: _Session(self, drop), wire.SCHEMA)

    @property
    def endpoint_address(self) -> tuple[str, int]:
        return self._control.address

    # -- KVReceiver API -------------------------------------------------------------------------
    def expect(self, request_id: str, slots: torch.Tensor, num_parts: int) -> None:
        assert slots.dim() == 1 and num_parts >= 1
        slots = slots.to(self.kv_cache.device, torch.int64)
        with self._lock:
            self._expected[request_id] = _Expected(slots, num_parts, whole_blocks(slots, self.block_size),
                                                   slot_runs(slots))

    def cancel(self, request_id: str) -> None:
        """Once this returns, nothing more is written into the request's slots: scatters happen
        under the lock; a receive straight into them is waited for (its deadline bounds it)."""
        with self._lock:
            e = self._expected.pop(request_id, None)
            while e is not None and e.receiving:
                self._receives_done.wait()

    def poll(self) -> tuple[list[CompletedTransfer], list[tuple[str, str]]]:
        now, stalled = time.monotonic(), set()
        with self._lock:
            for rid, e in list(self._expected.items()):
                if e.last_activity is None or e.receiving:  # a receive in flight has a deadline of its own
                    continue
                # A connection busy with other requests' KV is alive: this part waits in its queue.
                busy = max((s.activity for s in e.sessions), default=0.0)
                if now - max(e.last_activity, busy) > self.timeout_s:
                    self._fail(rid, f"no KV for {self.timeout_s:.0f} s after the transfer began")
                    stalled |= e.sessions
            done, self._completed = self._completed, []
            failed, self._failed = self._failed, []
        for session in stalled:  # past its deadline, the pair is aborted; the sender rebuilds it
            session.drop()
        return done, failed

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
        out["garbage_messages"] = self._control.stats["garbage"]
        return out

    def close(self) -> None:
        self._control.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions), set()
        for session in sessions:
            if session.channel is not None:
                session.channel.close()
        self._store = None  # its server stops once the channels let go of their clients

    # -- the sessions' calls -----------------------------------------------------------------------
    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _fail(self, rid: str, reason: str) -> None:
        """Holding the lock."""
        if self._expected.pop(rid, None) is not None:
            self._failed.append((rid, reason))
            self._stats["failed"] += 1

    def _hello(self, session: _Session, msg: dict) -> dict:
        reply = {"kind": "welcome", "ok": False, "error": None, "compat": self.compat.to_dict(),
                 "store_port": self._store.port, "channel": -1}
        try:
            reply["error"] = self.compat.mismatch(CompatRecord.from_dict(msg["compat"]))
        except ValueError as exc:
            reply["error"] = f"malformed hello: {exc}"
        session.sender_id = msg["sender_id"]
        with self._lock:
            if reply["error"] is not None:
                logger.warning("refused KV sender %s: %s", session.sender_id, reply["error"])
                self._stats["refused_peers"] += 1
                return reply
            self._stats["connections"] += 1
            session.index = reply["channel"] = self._stats["connections"]
            self._sessions.add(session)
        reply["ok"] = True
        return reply

    def _open(self, index: int) -> DataChannel:
        """This end of a data channel. Rendezvous goes through the master store object itself:
        one more client per connection made torch's TCPStore refuse connections after a few."""
        store = self._store
        if store is None:
            raise ControlGarbage("the receiver is closed")
        try:
            return open_channel(store, index, RECEIVER, self.kv_cache.device, self.host, self.timeout_s)
        except (RuntimeError, OSError) as exc:  # the sender did not join in time
            raise ControlGarbage(f"data channel {index} was not built: {exc}") from None

    def _begin(self, session: _Session, msg: dict) -> dict:
        rid, lo = msg["request_id"], msg["head_start"] - self.head_offset
        reply = {"kind": "ready", "request_id": rid, "ok": False, "error": None, "runs": []}
        n_heads = msg["head_end"] - msg["head_start"]
        if not (0 <= lo and 0 < n_heads and lo + n_heads <= self.num_local_heads and msg["num_tokens"] > 0):
            raise ControlGarbage(f"begin does not fit this rank: {msg}")
        with self._lock:
            e = self._expected.get(rid)
            if e is None:
                self._stats["unknown_requests"] += 1
                reply["error"] = "unknown or cancelled request"
            elif msg["num_tokens"] != e.slots.numel():
                reply["error"] = f"sent {msg['num_tokens']} tokens, expected {e.slots.numel()}"
                self._fail(rid, reply["error"])
            else:
                direct = lo == 0 and n_heads == self.num_local_heads and len(e.runs) <= MAX_DIRECT_RUNS
                part = _Part(lo, n_heads, msg["num_tokens"], e.runs if direct else [])
                session.parts[(rid, msg["head_start"])] = part
                e.sessions.add(session)
                e.last_activity = time.monotonic()
                reply["ok"] = True
                reply["runs"] = [[start, length] for start, length, _ in part.runs]
        return reply

    def _receiving(self, rid: str) -> _Expected | None:
        """A receive straight into the request's slots starts: its _Expected (None: it is gone)."""
        with self._lock:
            if (e := self._expected.get(rid)) is not None:
                e.receiving += 1
            return e

    def _received(self, rid: str, part: _Part, e: _Expected | None, layers: int, num_bytes: int) -> None:
        """Ends what `_receiving` began (e: what it returned): `layers` of the part landed."""
        with self._lock:
            self._stats["bytes_received"] += num_bytes
            if e is not None:
                e.receiving -= 1
                self._receives_done.notify_all()
            if e is None or self._expected.get(rid) is not e:  # cancelled or failed: dropped
                self._stats["dropped_layers"] += layers
                return
            part.layers += layers
            self._stats["layers_direct"] += layers
            e.last_activity = time.monotonic()

    def _write(self, session: _Session, rid: str, layer: int, part: _Part, payload: torch.Tensor) -> None:
        kv = payload.view(self.kv_cache.dtype).view(2, part.num_tokens, part.num_heads, self.compat.head_dim)
        with self._lock:
            self._stats["bytes_received"] += payload.numel()
            e = self._expected.get(rid)
            if e is None:  # cancelled or failed meanwhile: the payload is dropped
                self._stats["dropped_layers"] += 1
                return
            with session.channel.writing():
                scatter_layer(self.kv_cache[layer], e.slots, e.block_ids, kv, part.lo)
            part.layers += 1
            self._stats["layers_scattered"] += 1
            e.last_activity = time.monotonic()

    def _done(self, session: _Session, msg: dict, part: _Part) -> dict:
        rid = msg["request_id"]
        reply = {"kind": "ack", "request_id": rid, "ok": False, "error": None}
        session.channel.settle(self.timeout_s)  # CUDA: this part's writes are done before admission
        with self._lock:
            e = self._expected.get(rid)
            if e is None:
                self._stats["unknown_requests"] += 1
                reply["error"] = "unknown or cancelled request"
                return reply
            if part.layers != msg["num_layers"] or part.layers != self.compat.num_layers:
                reply["error"] = f"received {part.layers} of {self.compat.num_layers} layers"
                self._fail(rid, reply["error"])
                return reply
            e.parts_done += 1
            e.first_token = max(e.first_token, msg["first_token"])
            if msg["logprobs"] is not None:
                e.logprobs = wire.unpack_logprobs(msg["logprobs"])
            if e.parts_done == e.num_parts:
                del self._expected[rid]
                self._completed.append(CompletedTransfer(rid, e.first_token, e.logprobs))
                self._stats["completed"] += 1
        reply["ok"] = True
        return reply

    def _closed_session(self, session: _Session) -> None:
        with self._lock:
            self._sessions.discard(session)
            for rid, _ in session.parts:
                self._fail(rid, f"connection from {session.sender_id} closed mid-transfer")
            for e in self._expected.values():
                e.sessions.discard(session)
