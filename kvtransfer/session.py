"""One prefill rank's connection to a KV receiver (receiver.py): its control messages, answered
in order on the connection's thread, and its data channel. A layer's receives are posted at once;
a writer thread waits for them (and scatters a buffer into the request's slots) while later
layers arrive, at most RECEIVE_DEPTH layers or spans in flight. A shared connection (same
device) has no data channel: its sender writes granted layers into the cache itself.

With checksums (`compat.kv_checksum`) each part hashes what arrived in the order it crossed: a
scattered layer's buffer, or, for layers received straight into the cache, the runs' slots read
back once they landed; for layers a same-device sender wrote, the part's slots read back at
`done`, K then V of every token. `done` compares (receiver.py). A payload MAC (wire.py
PartMac, keyed by this connection's `payload_key`) covers the same bytes on a data channel: a
part's `done` must carry one exactly when the session has a key and is not shared."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvtransfer import wire
from kvtransfer.base import MAX_TRAILER_BYTES
from kvtransfer.channel import ChannelError, DataChannel
from kvtransfer.wire import PartChecksum, PartMac
from kvtransfer.control import ControlError, ControlGarbage
from kvtransfer.rendezvous import Rendezvous
from kvtransfer.scatter import as_bytes

if TYPE_CHECKING:
    from kvtransfer.params import CompatRecord

logger = logging.getLogger(__name__)
# Layers (or announced spans, received straight into the cache) posted and not yet written, per
# connection; each scattered one holds a buffer of its size. 4 measured faster than 2 (8: no better).
RECEIVE_DEPTH = 4
FEW_RUNS = 4  # a same-device part's slots hashed run by run up to this many runs; more are gathered first


@dataclass
class Part:
    lo: int  # first local head
    num_heads: int
    num_tokens: int
    runs: list[tuple[int, int, int]]  # received straight into the cache; [] to scatter
    layers: int = 0
    checksum: PartChecksum | None = None  # of what arrived so far (kv_checksum on)
    mac: PartMac | None = None  # of what arrived so far (an authenticated data channel)
    trailer: list[bytes] = field(default_factory=list)  # its `trailer` chunks so far (base.py: carried unread)
    trailer_bytes: int = 0
    reads: object = None  # the nixl transport's: what to read of the sender's pool (nixl_reads.ReadPlan)

    def hash(self, payload: torch.Tensor) -> None:
        """Adds bytes that arrived to the checksum and the MAC (those the part has)."""
        if self.checksum is not None:
            self.checksum.update(payload)
        if self.mac is not None:
            self.mac.update(payload)

    @property
    def hashed(self) -> bool:
        return self.checksum is not None or self.mac is not None


@dataclass
class Expected:
    slots: torch.Tensor  # (num_tokens,) int64
    num_parts: int
    block_ids: torch.Tensor | None  # (num_tokens // block_size,) when the slots fill whole blocks in order
    runs: list[tuple[int, int, int]]  # slot_runs(slots)
    sessions: set = field(default_factory=set)  # the connections its parts arrive on
    parts_done: int = 0
    trailer: bytes = b""  # the one a part carried (b"" if none did)
    trace: str = ""  # the traceparent its first part's `begin` carried (engine/core/tracing.py; "": none)
    began_ns: int = 0  # when its first part began (time.time_ns())
    last_activity: float | None = None  # set when its first part begins
    receiving: int = 0  # receives in flight straight into its slots
    host_slots: torch.Tensor | None = None  # `slots` on the host


class SessionHost(Protocol):
    """What a session reads of the receiver that accepted it (receiver.py `TorchDistReceiver` is the
    one there is): its cache and counters, and the handlers of each message. A protocol, so that
    the receiver imports this module and not the other way round."""

    kv_cache: list[torch.Tensor]  # per layer (2, num_blocks, block_size, num_local_heads, head_dim)
    num_slots: int
    num_local_heads: int
    timeout_s: float
    compat: CompatRecord

    def count(self, key: str, n: int = 1) -> None: ...

    def on_hello(self, session: Session, msg: dict) -> dict: ...

    def open_data_channel(self, session: Session) -> DataChannel: ...

    def on_begin(self, session: Session, msg: dict) -> dict: ...

    def start_receiving(self, rid: str) -> Expected | None: ...

    def on_received(self, rid: str, part: Part, e: Expected | None, layers: int, num_bytes: int) -> None: ...

    def write_part(self, session: Session, rid: str, layer: int, part: Part, payload: torch.Tensor) -> None: ...

    def on_done(self, session: Session, msg: dict, part: Part) -> dict: ...

    def on_session_closed(self, session: Session) -> None: ...


class Session:
    """One prefill rank's connection: its messages, in order, on the connection's thread."""

    def __init__(self, rx: SessionHost, drop, payload_key: bytes | None = None):
        """`payload_key`: this connection's payload MAC key (auth.payload_key), None for none."""
        self.rx, self.drop, self.payload_key = rx, drop, payload_key
        self.rendezvous: Rendezvous | None = None  # the data channel's store, from hello until built
        self.sender_id, self.index = "?", None
        self.channel: DataChannel | None = None
        self.offered = self.shared = False  # offered the cache at hello; joined to write into it
        self.data_channel = "gloo"  # the kind the welcome named (channel.py: data_channel_kind)
        # shared: (request id, head_start) -> (part, its Expected, when `ready` granted its slots) until `done`
        self.granted: dict[tuple[str, int], tuple[Part, Expected, float]] = {}
        self.parts: dict[tuple[str, int], Part] = {}  # (request id, head_start) -> begun, not done
        self.activity = time.monotonic()
        # receive buffers: later layers arrive in some while the writer thread scatters one from another
        self.buffers = [torch.empty(0, dtype=torch.uint8, device=rx.kv_cache.device) for _ in range(RECEIVE_DEPTH)]
        self.writes: list[Future | None] = [None] * RECEIVE_DEPTH
        self.next_buffer = 0
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write")

    def __call__(self, msg: dict) -> dict | None:
        self.activity = time.monotonic()
        kind = msg["kind"]
        if kind == "hello" and self.index is None:
            return self.rx.on_hello(self, msg)
        joined = self.channel is not None or self.shared
        if kind == "join" and self.index is not None and not joined and msg["channel"] == self.index:
            if msg["shared"] and not self.offered:
                raise ControlGarbage("joined shared without the cache being offered")
            self.shared = msg["shared"]
            if self.shared:
                self.end_rendezvous()
            else:
                self.channel = self.rx.open_data_channel(self)
            return None
        if not joined or kind not in ("begin", "layer", "trailer", "done") or (kind == "layer" and self.shared):
            raise ControlGarbage(f"{kind} message out of order")
        if kind == "begin":
            if self.data_channel != "nccl":  # the sender's end is built: it needs the store no more
                self.end_rendezvous()
            return self.rx.on_begin(self, msg)
        part = self.parts.get((msg["request_id"], msg["head_start"]))
        if part is None:
            raise ControlGarbage(f"{kind} for a part that did not begin: {msg['request_id']}")
        if kind == "layer":
            return self._layer(msg, part)
        if kind == "trailer":
            return self._trailer(msg, part)
        if msg["trailer_bytes"] != part.trailer_bytes:
            raise ControlGarbage(f"done of {msg['request_id']} says {msg['trailer_bytes']} trailer bytes, "
                                 f"{part.trailer_bytes} came")
        if (msg["checksum"] is None) != (part.checksum is None):
            raise ControlGarbage(f"done {'with' if part.checksum is None else 'without'} a checksum, "
                                 f"kv_checksum is {part.checksum is not None} here")
        if (msg["mac"] is None) != (part.mac is None):
            raise ControlGarbage(f"done {'with' if part.mac is None else 'without'} a payload MAC, "
                                 f"which this connection {'does not' if part.mac is None else 'does'} carry")
        if self.shared:
            self._wrote(msg, part)
        else:
            self._written()
        del self.parts[(msg["request_id"], msg["head_start"])]
        return self.rx.on_done(self, msg, part)

    def _trailer(self, msg: dict, part: Part) -> None:
        """A chunk of the part's trailer, kept until its `done`."""
        part.trailer_bytes += len(msg["data"])
        if part.trailer_bytes > MAX_TRAILER_BYTES:
            raise ControlGarbage(f"a trailer of {msg['request_id']} over {MAX_TRAILER_BYTES} bytes")
        part.trailer.append(msg["data"])
        self.rx.count("trailer_bytes_received", len(msg["data"]))

    def _layer(self, msg: dict, part: Part) -> None:
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

    def _wrote(self, msg: dict, part: Part) -> None:
        """Shared: `done` says the part's layers are in the cache; its grant ends (the slots read
        back first for a checksum, while a cancel still waits)."""
        num_layers = msg["num_layers"]
        if not 0 <= num_layers <= self.rx.compat.num_layers:
            raise ControlGarbage(f"done of {num_layers} layers, of {self.rx.compat.num_layers}")
        _, e, _ = self.granted.pop((msg["request_id"], msg["head_start"]))
        if part.checksum is not None:
            self._hash_written(num_layers, part, e)
        num_bytes = num_layers * wire.payload_bytes(part.num_tokens, part.num_heads, self.rx.compat.head_dim,
                                                    self.rx.kv_cache.dtype)
        self.rx.on_received(msg["request_id"], part, e, num_layers, num_bytes)

    def granted_since(self) -> float:
        """When the oldest grant still awaiting its `done` was given (inf: none)."""
        return min((when for *_, when in list(self.granted.values())), default=float("inf"))

    def _scatter(self, msg: dict, layer: int, part: Part, handle, payload: torch.Tensor) -> None:
        """On the writer thread: once the layer is in the buffer, into the request's slots."""
        try:
            self.channel.wait(handle, self.rx.timeout_s)
        except ChannelError as exc:  # the pair is aborted (the channel already is); the sender rebuilds it
            self._payload_failed(msg, exc)
        self.activity = time.monotonic()
        if part.hashed:
            with self.channel.writing():  # CUDA: the receive ran on the channel's stream
                part.hash(payload)
        self.rx.write_part(self, msg["request_id"], layer, part, payload)

    def _hash_landed(self, msg: dict, part: Part) -> None:
        """Adds the announced layers' bytes to the part's checksum, read back from the slots they
        were received into: K, then V, of each run, the order they crossed (as `_post_direct`
        posted them; such a part has all of the rank's heads)."""
        rx = self.rx
        with self.channel.writing():  # CUDA: the receives ran on the channel's stream
            for layer in range(msg["layer"], msg["layer"] + msg["count"]):
                cache = rx.kv_cache[layer].view(2, rx.num_slots, -1)  # (2, slots, heads * head_dim)
                for _, length, slot in part.runs:
                    for k in (0, 1):
                        part.hash(cache[k, slot:slot + length])

    def _hash_written(self, num_layers: int, part: Part, e: Expected) -> None:
        """Shared: adds layers 0 .. num_layers - 1, which a same-device sender wrote, to the part's
        checksum, read back from the request's slots as the sender held them, K then V of every
        token: run by run for a few runs, else after one gather a layer (a hash call per run cost
        more, measured)."""
        rx, heads = self.rx, slice(part.lo, part.lo + part.num_heads)
        for layer in range(num_layers):
            cache = as_bytes(rx.kv_cache[layer]).view(2, rx.num_slots, rx.num_local_heads, -1)
            if len(part.runs) > FEW_RUNS:
                part.checksum.update(cache[:, e.slots, heads])  # (2, tokens, heads, hd)
                continue
            for k in (0, 1):
                for _, length, slot in part.runs:
                    part.checksum.update(cache[k, slot:slot + length, heads])

    def _next_write(self) -> int:
        """The write slot to use next, once the write it held before is done."""
        i = self.next_buffer
        self.next_buffer = (i + 1) % RECEIVE_DEPTH
        self._written(i)
        return i

    def _post_direct(self, msg: dict, part: Part) -> tuple:
        """Posts receives of the layers' K and V of each run straight into the request's slots (or,
        if it was cancelled, into a buffer that is dropped). Returns (its Expected, handles, error)."""
        e = self.rx.start_receiving(msg["request_id"])
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

    def _land(self, msg: dict, part: Part, e: Expected | None, handles: list, error: Exception | None) -> None:
        """On the writer thread: waits for every posted receive to end (after a failure the channel
        is aborted: at once), then releases the request's slots to cancel()."""
        for handle in handles:
            try:
                self.channel.wait(handle, self.rx.timeout_s)
            except ChannelError as exc:
                error = error or exc
        if error is None and e is not None and part.hashed:  # before cancel() may free them
            self._hash_landed(msg, part)
        num_bytes = msg["count"] * wire.payload_bytes(part.num_tokens, part.num_heads, self.rx.compat.head_dim,
                                                      self.rx.kv_cache.dtype)
        self.rx.on_received(msg["request_id"], part, e, msg["count"] if error is None else 0, num_bytes)
        if error is not None:
            self._payload_failed(msg, error)
        self.activity = time.monotonic()

    def _payload_failed(self, msg: dict, exc: Exception):
        self.rx.count("payload_failures")
        logger.warning("KV from %s: payload of %s layer %d: %s", self.sender_id, msg["request_id"], msg["layer"], exc)
        raise ControlError(str(exc)) from None

    def _written(self, i: int | None = None) -> None:
        """Waits for the write from buffer `i` (None: all) to finish; its error is this session's."""
        for k in range(RECEIVE_DEPTH) if i is None else (i,):
            if self.writes[k] is not None:
                self.writes[k], future = None, self.writes[k]
                future.result()

    def part_mac(self, request_id: str, head_start: int, num_tokens: int) -> PartMac | None:
        """The MAC a part begun on this connection is checked against (None: none)."""
        if self.payload_key is None or self.shared:
            return None
        return PartMac(self.payload_key, request_id, head_start, num_tokens)

    def end_rendezvous(self) -> None:
        """The data channel's store stops listening (repeatable)."""
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    def close(self) -> None:
        self.end_rendezvous()
        if self.channel is not None:  # first: receives still posted end at once, so cancel() waits no longer
            self.channel.close()
        self.writer.shutdown(wait=True)
        for (rid, _), (part, e, _) in list(self.granted.items()):  # a dead or stuck sender's grants end:
            self.rx.on_received(rid, part, e, 0, 0)  # a cancel waits no longer
        self.granted.clear()
        self.rx.on_session_closed(self)
