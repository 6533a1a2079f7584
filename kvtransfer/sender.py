"""The prefill side of the KV connector's transport.

One `_Peer` per decode rank this prefill rank talks to, in an LRU pool of at most `max_groups`:
each owns a control connection (control.py), a data channel built after the handshake
(channel.py), and a queue of operations that its thread carries out in order, so the model keeps
computing while layers leave. Every step has a deadline of `timeout_s`: the handshake, the
`begin` a part waits on before any payload moves, each layer, the ack. A peer that fails
(refused handshake, dead or silent receiver, a deadline passed) fails its queued parts, aborts
its channel and leaves the pool; the next `begin` to that address builds a fresh one. A part the
receiver refuses (request unknown or cancelled, wrong size) fails alone. An idle peer checks its
control connection every IDLE_CHECK_S: closed by the receiver (its process ended), it leaves the
pool at once, with its channel and the receiver's cache it opened, instead of holding them until
`max_groups` newer peers push it out.

A receiver on this rank's device (shared_cache.device_key) offers its cache at the handshake:
the peer opens it and, from `ready` on, writes the part's layers into its slots itself, one copy
and no data channel, no message per layer (scatter.py; docs/disaggregation.md, "Same
device"). Before `done` it waits for one event after every copy queued so far, so a step's parts
cost one event. The mapping lives as long as the peer, or until stalled copies complete. A
welcome offering another process's cache (a restarted decode rank) ends older peers holding the old one. If the
cache cannot be opened, the peer says so in the log and joins the data channel instead; which
data channel (gloo, NCCL, or gloo through host memory for two ranks of one GPU) the receiver
names in its welcome (channel.py: data_channel_kind).

Checksums (`compat.kv_checksum`) and payload MACs (keyed from the control connection's session
key) of what a part sends travel in its `done` (wire.py); the channel rendezvouses in a store the
receiver made for this connection (rendezvous.py). The control connection proves the cluster
secret both ways before the hello (control.py): a receiver that refuses this rank's secret, or
cannot prove its own, fails the peer like any broken connection (logged, `groups_failed`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict, deque

import torch

from engine.core.threads import run_serially
from kvtransfer import wire
from kvtransfer.base import MAX_TRAILER_BYTES, IncompatiblePeerError, KVSender, Transfer, TransferError
from kvtransfer.channel import DATA_CHANNELS, SENDER, DataChannel
from kvtransfer.channel_factory import open_channel
from kvtransfer.wire import PartChecksum, PartMac
from kvtransfer.control import ControlClient
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.rendezvous import join
from kvtransfer.shared_cache import device_key, export_event, open_cache
from kvtransfer.scatter import SharedCacheManager, SharedCacheWriter

logger = logging.getLogger(__name__)
MAX_INFLIGHT = 8  # payload messages posted and not yet complete, per connection
MAX_SPAN = 8  # layers announced by one message, when that many are queued
IDLE_CHECK_S = 0.5  # how often an idle connection checks whether the receiver closed it
LOST = ("lost", None, None, None)  # the op an idle peer gives itself when the receiver closed the connection


class _Transfer(Transfer):
    def __init__(self, peer: _Peer, request_id: str, head_start: int, head_end: int, num_tokens: int, trace=""):
        self.peer, self.request_id, self.trace = peer, request_id, trace
        self.head_start, self.head_end, self.num_tokens = head_start, head_end, num_tokens
        self.num_layers_sent = self.num_bytes = 0
        self.begun = False  # the receiver answered `ready`
        self.runs: list[list[int]] = []  # where the receiver takes payloads straight into its cache (wire.py)
        self.target: tuple | None = None  # shared connection: where its tokens go (SharedCacheWriter.target)
        self.posted_before_done, self.error = 0, None  # the peer's payload count when `done` was sent; why it failed
        self.checksum = PartChecksum() if peer.owner.compat.kv_checksum else None
        self.mac: PartMac | None = None  # set once begun, on a connection with a payload key
        self._done = threading.Event()
        # time.monotonic() stamps: begin, finish() called (the trailer known), acknowledged
        self.begin_s, self.finish_s, self.acked_s = time.monotonic(), None, None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        assert kv.shape[:3] == (2, self.num_tokens, self.head_end - self.head_start), kv.shape
        ready = None
        if kv.is_cuda:  # the copy is queued on the compute stream: the channel's stream waits for it
            ready = torch.cuda.Event()
            ready.record()
        self.peer.submit(("layer", self, layer, (kv, ready)))

    def finish(self, trailer: bytes = b"") -> None:
        if len(trailer) > MAX_TRAILER_BYTES:
            raise ValueError(f"a trailer of {len(trailer)} bytes; at most {MAX_TRAILER_BYTES}")
        self.finish_s = time.monotonic()
        self.peer.submit(("done", self, bytes(trailer), None))

    def fail(self, reason: str) -> None:
        if not self._done.is_set():
            self.error = reason
            self._done.set()

    def succeed(self) -> None:
        self.acked_s = time.monotonic()
        self.peer.owner._log(self)
        self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TransferError(f"{self.request_id}: no acknowledgement within {timeout} s")
        if self.error is not None:
            raise (IncompatiblePeerError if self.error.startswith("refused") else TransferError)(self.error)


class _Peer:
    """The connection to one decode rank and the thread that feeds it."""

    def __init__(self, owner: TorchDistSender, dest: KVEndpoint):
        self.owner, self.dest = owner, dest
        self.control = ControlClient(dest.address, owner.schema, authenticate=owner.control_auth)
        self.channel: DataChannel | None = None
        self.shared: SharedCacheWriter | None = None  # the receiver's cache, opened here (same device)
        self.payload_key: bytes | None = None  # this connection's payload MAC key, once its data channel is built
        self.cache_pid: int | None = None  # the process whose cache `shared` is
        self.abandoned: str | None = None  # why another thread ended this connection
        self.inflight: deque = deque()  # (number, send handle, payload) posted, not yet waited on
        self.posted = 0  # payload messages posted so far
        self.unacked: deque[_Transfer] = deque()  # parts whose `done` was sent, in order
        self.closed = False
        self._lock = threading.Lock()
        self._ops: queue.Queue = queue.Queue()
        self._held: list = []  # an op taken from _ops while gathering layers, not carried out yet
        threading.Thread(target=self._run, daemon=True, name=f"kv-send-{dest.host}:{dest.port}").start()

    @property
    def name(self) -> str:
        return f"{self.dest.instance_id} rank {self.dest.rank}"

    def _gather(self, t: _Transfer, layer: int, payload: tuple) -> tuple[list[int], list[tuple]]:
        """Layer `layer` of `t` and the layers after it already queued (at most MAX_SPAN in all):
        one announcement for all of them."""
        layers, payloads = [layer], [payload]
        while len(layers) < MAX_SPAN:
            try:
                nxt = self._ops.get_nowait()
            except queue.Empty:
                break
            if nxt is None or nxt[0] != "layer" or nxt[1] is not t or nxt[2] != layers[-1] + 1:
                self._held.append(nxt)
                break
            layers.append(nxt[2])
            payloads.append(nxt[3])
        return layers, payloads

    def submit(self, op: tuple) -> None:
        with self._lock:
            if not self.closed:
                self._ops.put(op)
                return
        op[1].fail(f"connection to {self.name} was closed")

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._ops.put(None)

    def abandon(self, reason: str) -> None:
        """Ends this connection from another thread (its receiver's process is gone): what is
        pending fails with `reason`; the cache it opened goes once its copies completed."""
        self.abandoned = reason
        self.close()
        self.control.shutdown()  # wakes a receive blocked on it

    def _run(self) -> None:
        run_serially()  # it gathers and copies KV: no OpenMP team of its own (engine/core/threads.py)
        broken: str | None = None
        while True:
            if self.unacked and not self._held and self._ops.empty() and broken is None:
                broken = self._guarded(self._answer, None)  # nothing to send: hear the acks
            if (op := self._held.pop() if self._held else self._next_op(broken is None)) is None:
                break
            kind, transfer, a, b = op
            if kind == "lost":  # idle: the receiver's process ended (or restarted); no transfer failed
                logger.info("KV connection to %s closed by the receiver: it leaves the pool with its channel and "
                            "the cache it opened", self.name)
                broken = self._end(f"KV connection to {self.name} closed by the receiver", False)
            elif broken is not None or transfer.error is not None:
                transfer.fail(transfer.error or broken)
            else:
                broken = self._guarded(self._carry_out, kind, transfer, a, b)
        if broken is None:  # closing: what it sent is acknowledged first
            self._guarded(self._answer, None)
        if self.channel is not None:
            self.channel.close()
        self.control.close()
        self._release_shared()

    def _next_op(self, watch: bool) -> tuple | None:
        """The next operation; while none comes, with `watch`, LOST once the receiver closed the
        connection (checked every IDLE_CHECK_S, without reading anything)."""
        while True:
            try:
                return self._ops.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if watch and self.control.closed_by_peer():
                    return LOST

    def _release_shared(self) -> None:
        """The receiver's cache goes with this connection once its copies completed; a writer
        whose copies stalled is parked with the sender until they do (never unmapped under one)."""
        writer, self.shared = self.shared, None
        if writer is not None:
            self.owner._unmapped(self, writer)

    def _guarded(self, step, *args) -> str | None:
        """Runs one step; any failure (refused, a deadline, the peer gone, a bug) ends this
        connection: it leaves the pool, then the step's part and every part awaiting an ack fail."""
        try:
            step(*args)
            return None
        except Exception as exc:
            broken = str(exc) if isinstance(exc, IncompatiblePeerError) else (
                f"KV connection to {self.name} failed: {self.abandoned or exc}")
            logger.warning("%s", broken)
            return self._end(broken, True, *([args[1]] if step == self._carry_out else []))

    def _end(self, broken: str, failed: bool, *transfers: _Transfer) -> str:
        """This connection ends: it leaves the pool (counted as `failed` or not) before anyone
        waiting hears of it; then `transfers` and every part awaiting an ack fail with `broken`."""
        self.owner._drop(self, failed)
        for t in [*transfers, *self.unacked]:
            t.fail(broken)
        self.unacked.clear()
        return broken

    def _carry_out(self, kind: str, t: _Transfer, a, b) -> None:
        timeout = self.owner.timeout_s
        if self.channel is None and self.shared is None:
            self._connect(timeout)
        if not t.begun:
            self.control.send({"kind": "begin", "request_id": t.request_id, "head_start": t.head_start,
                               "head_end": t.head_end, "num_tokens": t.num_tokens, "trace": t.trace}, timeout)
            ready = self._answer(t)
            if not ready["ok"]:  # the receiver is fine, this request is not (cancelled, wrong size)
                self.owner.count("parts_rejected")
                return t.fail(f"receiver rejected {t.request_id}: {ready['error']}")
            try:
                wire.check_runs(ready["runs"], t.num_tokens)
                if self.shared is not None:
                    t.target = self.shared.target(ready["runs"], ready["slots"], t.num_tokens)
            except (wire.WireError, ValueError) as exc:
                raise TransferError(f"{self.name} answered begin with bad runs: {exc}") from None
            t.begun, t.runs = True, ready["runs"]
            if self.payload_key is not None:
                t.mac = PartMac(self.payload_key, t.request_id, t.head_start, t.num_tokens)
        if kind == "layer":
            if self.shared is not None:
                return self._write_layer(t, a, *b)
            return self._send_layers(t, *self._gather(t, a, b))
        if self.shared is not None:  # `done` says the part is in the cache: so it must be
            self.shared.settle(timeout)
        for msg in wire.trailer_messages(t.request_id, t.head_start, a):
            self.control.send(msg, timeout)
            self.owner.count("trailer_bytes_sent", len(msg["data"]))
        # not waited on: the receiver acks once every payload is in; the next part goes on meanwhile
        self.control.send({"kind": "done", "request_id": t.request_id, "head_start": t.head_start,
                           "num_layers": t.num_layers_sent, "trailer_bytes": len(a),
                           "checksum": None if t.checksum is None else t.checksum.value,
                           "mac": None if t.mac is None else t.mac.value}, timeout)
        t.posted_before_done = self.posted
        self.unacked.append(t)

    def _answer(self, t: _Transfer | None, kind: str = "ready") -> dict | None:
        """Reads replies until `t`'s `kind` (t None: until every `done` sent is acked). Replies
        come in order; acks on the way settle their parts."""
        while t is not None or self.unacked:
            msg = self.control.receive(self.owner.timeout_s)
            if self.unacked and msg["kind"] == "ack" and msg["request_id"] == self.unacked[0].request_id:
                self._acked(self.unacked.popleft(), msg)
                continue
            if t is None:
                raise TransferError(f"out-of-order answer {msg} (waiting for acks)")
            self._check_answer(msg, kind, t)
            return msg
        return None

    def _acked(self, t: _Transfer, ack: dict) -> None:
        while self.inflight and self.inflight[0][0] < t.posted_before_done:  # received: they are complete
            self.channel.wait(self.inflight.popleft()[1], self.owner.timeout_s)
        if ack["ok"]:
            self.owner.count("parts_sent")
            t.succeed()
        else:
            self.owner.count("parts_rejected")
            t.fail(f"receiver rejected {t.request_id}: {ack['error']}")

    def _send_layers(self, t: _Transfer, layers: list[int], payloads: list[tuple]) -> None:
        self.control.send({"kind": "layer", "request_id": t.request_id, "head_start": t.head_start,
                           "layer": layers[0], "count": len(layers)}, self.owner.timeout_s)
        num_bytes = 0
        for kv, event in payloads:
            kv = kv.contiguous()
            # one message, or K then V of each run (each a contiguous slice of kv)
            for payload in [kv[k, start:start + length] for start, length in t.runs for k in (0, 1)] or [kv]:
                payload = payload.view(-1).view(torch.uint8)
                # posted, not waited on: the next announcement goes out while this payload moves
                self.inflight.append((self.posted, self.channel.isend(payload, event), payload))
                self.posted += 1
                # hashed while it moves (both hashes release the GIL): the source bytes, which the
                # channel only reads
                if t.checksum is not None:
                    t.checksum.update(payload, event)
                if t.mac is not None:
                    t.mac.update(payload, event)
                if len(self.inflight) > MAX_INFLIGHT:
                    self.channel.wait(self.inflight.popleft()[1], self.owner.timeout_s)
                num_bytes += payload.numel()
        t.num_layers_sent += len(layers)
        t.num_bytes += num_bytes
        self.owner.count("bytes_sent", num_bytes)

    def _write_layer(self, t: _Transfer, layer: int, kv: torch.Tensor, ready) -> None:
        """Shared: the layer's copy into the slots `ready` granted is queued (no message); the
        part's `done` waits for it with the rest of the step's (SharedCacheWriter.settle)."""
        if t.checksum is not None:  # K then V of the part's tokens: what the receiver reads back
            t.checksum.update(kv, ready)
        self.shared.write(layer, t.target, kv, ready, t.head_start)
        num_bytes = kv.numel() * kv.element_size()
        t.num_layers_sent += 1
        t.num_bytes += num_bytes
        self.owner.count("bytes_sent", num_bytes)
        self.owner.count("layers_shared")

    def _check_answer(self, msg: dict, kind: str, t: _Transfer) -> None:
        if msg["kind"] != kind or msg["request_id"] != t.request_id:
            raise TransferError(f"out-of-order answer {msg} (waiting for {kind} of {t.request_id})")

    def _connect(self, timeout: float) -> None:
        """The handshake, then the shared cache or the data channel the receiver names."""
        o = self.owner
        welcome = self._hello({"device_key": o.device_key}, timeout)
        if welcome["data_channel"] not in DATA_CHANNELS:
            raise TransferError(f"{self.name} names an unknown data channel {welcome['data_channel']!r}")
        why_not = welcome["no_cache_reason"]
        if welcome["cache"] is not None:
            why_not = self._open_shared(welcome["cache"]) if o.same_device else \
                "same-device writes are off on this rank (same_device False)"
            if why_not is None:
                self.control.send({"kind": "join", "channel": welcome["channel"], "shared": True}, timeout)
                o.count("shared_connections")
                return
        self._join_channel(welcome, why_not, timeout)

    def _hello(self, fields: dict, timeout: float) -> dict:
        """Sends the hello (id, compat record, `fields`); the welcome, once it accepts and agrees."""
        o = self.owner
        welcome = self.control.call({"kind": "hello", "sender_id": o.sender_id, "compat": o.compat.to_dict(),
                                     **fields}, timeout)
        if welcome["kind"] != "welcome":
            raise TransferError(f"{self.name} answered hello with {welcome['kind']}")
        if not welcome["ok"]:
            raise IncompatiblePeerError(f"refused by {self.name}: {welcome['error']}")
        try:
            theirs = CompatRecord.from_dict(welcome["compat"])
        except ValueError as exc:
            raise TransferError(f"{self.name} sent a bad compat record: {exc}") from None
        if (diff := o.compat.mismatch(theirs)) is not None:
            raise IncompatiblePeerError(f"refused {self.name}: {diff}")
        return welcome

    def _join_channel(self, welcome: dict, why_not: str | None, timeout: float) -> None:
        """Builds the data channel of the receiver's kind; `why_not`: why a receiver on this very
        device is not written into directly (logged with the kind: "host" means that pair)."""
        o, kind = self.owner, welcome["data_channel"]
        if why_not is not None:
            logger.info("KV to %s (this device) not written into its cache (%s): data channel %s", self.name, why_not,
                        "gloo through host memory (NCCL cannot pair two ranks of one GPU)" if kind == "host" else kind)
        try:
            store = join(self.dest.host, welcome["store_port"], welcome["store_prefix"], timeout)
            self.control.send({"kind": "join", "channel": welcome["channel"], "shared": False}, timeout)
            self.channel = open_channel(store, SENDER, kind, o.device, o.host, timeout)
        except (RuntimeError, OSError) as exc:  # TCPStore / group rendezvous failures
            raise TransferError(f"building the data channel to {self.name} failed: {exc}") from None
        o.count("groups_created")
        if o.payload_mac and (key := self.control.session_key) is not None:
            self.payload_key = wire.payload_key(key)

    def _open_shared(self, desc: dict) -> str | None:
        """Opens the receiver's cache (same device), after its export event on the writer's
        stream; why not (logged) when it cannot be opened here."""
        try:
            if desc.get("kind") == "cuda" and desc.get("pid") == os.getpid():
                raise ValueError("CUDA IPC cannot open a cache of this very process")
            device, pid = self.owner.device, int(desc["pid"])
            self.shared = SharedCacheWriter(open_cache(desc, device), int(desc["head_offset"]),
                                            export_event=export_event(desc, device))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("same-device KV transport to %s unavailable (%s): using the data channel", self.name, exc)
            return str(exc)
        self.cache_pid = pid
        self.owner._mapped(self)
        logger.info("KV to %s: written straight into its cache (same device)", self.name)
        return None


class TorchDistSender(KVSender):
    peer_class = _Peer  # a connection to one decode rank
    schema = wire.SCHEMA  # of its control messages

    def __init__(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
                 max_groups: int = 64, same_device: bool = False, *, control_auth: bool = True,
                 payload_mac: bool = True):
        """`same_device`: write into the caches of receivers on this rank's device (they offer them).
        The hello carries this rank's device_key whatever `same_device` says: a receiver on the same
        GPU must not pick NCCL (channel.py: data_channel_kind). `control_auth=False`: an
        unauthenticated control channel (control.py), for bench/kv_transfer.py's comparison only
        (TorchDistTransport never passes it); `payload_mac=False`: no payload MACs on an
        authenticated channel, for the same comparison only."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.compat, self.sender_id, self.timeout_s, self.host = compat, sender_id, timeout_s, host
        # the GPU whose KV this rank sends: current on the thread that builds the sender (the rank's)
        self.device = torch.device("cuda", torch.cuda.current_device()) if compat.device_type == "cuda" \
            else torch.device("cpu")
        self.device_key, self.same_device = device_key(self.device), same_device
        self.control_auth, self.payload_mac = control_auth, payload_mac
        self.caches = SharedCacheManager()  # receivers' caches opened here, and stalled writers
        self.max_groups = max_groups
        self._peers: OrderedDict[tuple[str, int], _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._stats: Counter = Counter()
        self._closed = False
        self.recent_transfers: deque[dict] = deque(maxlen=1024)  # for benchmarks and debugging
        self.transfer_seconds = 0.0  # sum over acknowledged parts of (acked - begin)

    def begin(self, request_id: str, dest: KVEndpoint, head_start: int, head_end: int,
              num_tokens: int, slots: torch.Tensor | None = None, trace: str = "") -> Transfer:
        self.caches.reap()
        return _Transfer(self._peer(dest), request_id, head_start, head_end, num_tokens, trace)

    def _peer(self, dest: KVEndpoint) -> _Peer:
        """The connection to `dest`, made if none is open (the LRU one past `max_groups` closes)."""
        with self._lock:
            if self._closed:
                raise TransferError("sender is closed")
            peer = self._peers.get(dest.address)
            if peer is None:
                peer = self._peers[dest.address] = self.peer_class(self, dest)
                if len(self._peers) > self.max_groups:
                    _, old = self._peers.popitem(last=False)
                    old.close()  # finishes what it has queued, then destroys its group
                    self._stats["groups_evicted"] += 1
            self._peers.move_to_end(dest.address)
        return peer

    def _drop(self, peer: _Peer, failed: bool = True) -> None:
        with self._lock:
            if self._peers.get(peer.dest.address) is peer:
                del self._peers[peer.dest.address]
            self._stats["groups_failed" if failed else "groups_closed_by_peer"] += 1
        peer.close()

    def _mapped(self, peer: _Peer) -> None:
        """`peer` opened its receiver's cache: an older connection still holding a cache of that
        address from another process holds a restarted decode rank's old one; it ends now."""
        for old in self.caches.opened(peer, peer.dest.address, peer.cache_pid):
            logger.warning("the decode rank at %s:%d restarted (pid %d, was %d): ending the connection that "
                           "holds its old cache", *peer.dest.address, peer.cache_pid, old.cache_pid)
            self.count("caches_of_restarted_peers")
            old.abandon(f"its decode rank restarted (pid {peer.cache_pid}, was {old.cache_pid})")

    def _unmapped(self, peer: _Peer, writer: SharedCacheWriter) -> None:
        if self.caches.closed(peer, writer, self.timeout_s):
            self.count("caches_released")
            return
        self.count("caches_parked")
        logger.warning("KV copies into the cache of %s stalled: its mapping and payloads are kept until they "
                       "complete (the connection's parts failed)", peer.name)

    def _log(self, t: _Transfer) -> None:
        self.transfer_seconds += t.acked_s - t.begin_s
        self.recent_transfers.append({"request_id": t.request_id, "bytes": t.num_bytes, "begin_s": t.begin_s,
                                      "finish_s": t.finish_s, "acked_s": t.acked_s})

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    @property
    def num_groups(self) -> int:
        return len(self._peers)

    @property
    def stats(self) -> dict[str, int]:
        """Counters, and `caches_parked_now`: writers whose stalled copies still hold a mapping."""
        parked = self.caches.reap()
        with self._lock:
            return dict(self._stats, caches_parked_now=parked)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), OrderedDict()
        for p in peers:
            p.close()
