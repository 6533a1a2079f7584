"""The prefill side of the KV connector's transport.

One `_Peer` per decode rank this prefill rank talks to, in an LRU pool of at most `max_groups`:
each owns a control connection (control.py), a data channel built after the handshake
(channel.py), and a queue of operations that its thread carries out in order, so the model keeps
computing while layers leave. Every step has a deadline of `timeout_s`: the handshake, the
`begin` a part waits on before any payload moves, each layer, the ack. A peer that fails
(refused handshake, dead or silent receiver, a deadline passed) fails its queued parts, aborts
its channel and leaves the pool; the next `begin` to that address builds a fresh one. A part the
receiver refuses (request unknown or cancelled, wrong size) fails alone.

A receiver on this rank's device (shared_cache.device_key) offers its cache at the handshake:
the peer opens it and writes each granted span of layers into the request's slots itself, one
copy and no data channel (docs/disaggregation.md, "Same-device transport"). If the cache
cannot be opened, the peer says so in the log and joins the data channel instead.

With `compat.kv_checksum` each part's `done` carries a checksum of its payloads (checksum.py),
taken from the tensors handed to the channel (or written into the shared cache) before they go.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.threads import run_serially
from kvtransfer import wire
from kvtransfer.base import IncompatiblePeerError, KVSender, Transfer, TransferError
from kvtransfer.channel import SENDER, DataChannel, open_channel
from kvtransfer.checksum import PartChecksum
from kvtransfer.control import ControlClient
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.shared_cache import SharedCacheWriter, device_key, open_cache

logger = logging.getLogger(__name__)
MAX_INFLIGHT = 8  # payload messages posted and not yet complete, per connection
MAX_SPAN = 8  # layers announced by one message, when that many are queued


class _Transfer(Transfer):
    def __init__(self, peer: _Peer, request_id: str, head_start: int, head_end: int, num_tokens: int):
        self.peer, self.request_id = peer, request_id
        self.head_start, self.head_end, self.num_tokens = head_start, head_end, num_tokens
        self.num_layers_sent = self.num_bytes = 0
        self.begun = False  # the receiver answered `ready`
        self.runs: list[list[int]] = []  # where the receiver takes payloads straight into its cache (wire.py)
        self.target: tuple | None = None  # shared connection: where its tokens go (SharedCacheWriter.target)
        self.posted_before_done = 0  # the peer's payload count when `done` was sent
        self.error: str | None = None
        self.checksum = PartChecksum() if peer.owner.compat.kv_checksum else None
        self._done = threading.Event()
        # time.monotonic() stamps: begin, finish() called (first token known), acknowledged
        self.begin_s, self.finish_s, self.acked_s = time.monotonic(), None, None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        assert kv.shape[:3] == (2, self.num_tokens, self.head_end - self.head_start), kv.shape
        ready = None
        if kv.is_cuda:  # the copy is queued on the compute stream: the channel's stream waits for it
            ready = torch.cuda.Event()
            ready.record()
        self.peer.submit(("layer", self, layer, (kv, ready)))

    def finish(self, first_token: int, logprobs: dict[int, float] | None = None, more_choices: tuple = ()) -> None:
        self.finish_s = time.monotonic()
        self.peer.submit(("done", self, first_token, (logprobs, more_choices)))

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
        self.control = ControlClient(dest.address, wire.SCHEMA)
        self.channel: DataChannel | None = None
        self.shared: SharedCacheWriter | None = None  # the receiver's cache, opened here (same device)
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

    def _run(self) -> None:
        run_serially()  # it gathers and copies KV: no OpenMP team of its own (engine/threads.py)
        broken: str | None = None
        while True:
            if self.unacked and not self._held and self._ops.empty() and broken is None:
                broken = self._guarded(self._answer, None)  # nothing to send: hear the acks
            if (op := self._held.pop() if self._held else self._ops.get()) is None:
                break
            kind, transfer, a, b = op
            if broken is not None or transfer.error is not None:
                transfer.fail(transfer.error or broken)
                continue
            broken = self._guarded(self._carry_out, kind, transfer, a, b)
        if broken is None:  # closing: what it sent is acknowledged first
            self._guarded(self._answer, None)
        if self.channel is not None:
            self.channel.close()
        self.control.close()

    def _guarded(self, step, *args) -> str | None:
        """Runs one step; any failure (refused, a deadline, the peer gone, a bug) ends this
        connection: it leaves the pool, then the step's part and every part awaiting an ack fail."""
        try:
            step(*args)
            return None
        except Exception as exc:
            broken = str(exc) if isinstance(exc, IncompatiblePeerError) else (
                f"KV connection to {self.name} failed: {exc}")
            logger.warning("%s", broken)
            self.owner._drop(self)  # out of the pool before anyone waiting hears of the failure
            for t in ([args[1]] if step == self._carry_out else []) + list(self.unacked):
                t.fail(broken)
            self.unacked.clear()
            return broken

    def _carry_out(self, kind: str, t: _Transfer, a, b) -> None:
        timeout = self.owner.timeout_s
        if self.channel is None and self.shared is None:
            self._connect(timeout)
        if not t.begun:
            self.control.send({"kind": "begin", "request_id": t.request_id, "head_start": t.head_start,
                               "head_end": t.head_end, "num_tokens": t.num_tokens}, timeout)
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
        if kind == "layer":
            send = self._write_layers if self.shared is not None else self._send_layers
            return send(t, *self._gather(t, a, b))
        # not waited on: the receiver acks once every payload is in; the next part goes on meanwhile
        self.control.send({"kind": "done", "request_id": t.request_id, "head_start": t.head_start,
                           "num_layers": t.num_layers_sent, "first_token": a, "logprobs": wire.pack_logprobs(b[0]),
                           "more_choices": [[tok, wire.pack_logprobs(lp)] for tok, lp in b[1]],
                           "checksum": None if t.checksum is None else t.checksum.value}, timeout)
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
                if t.checksum is not None:  # the source bytes, before they enter the channel
                    t.checksum.update(payload, event)
                # posted, not waited on: the next announcement goes out while this payload moves
                self.inflight.append((self.posted, self.channel.isend(payload, event), payload))
                self.posted += 1
                if len(self.inflight) > MAX_INFLIGHT:
                    self.channel.wait(self.inflight.popleft()[1], self.owner.timeout_s)
                num_bytes += payload.numel()
        t.num_layers_sent += len(layers)
        t.num_bytes += num_bytes
        self.owner.count("bytes_sent", num_bytes)

    def _write_layers(self, t: _Transfer, layers: list[int], payloads: list[tuple]) -> None:
        """Shared: once granted, the layers go straight into the receiver's slots; `wrote` once
        they are there (on CUDA: the copies completed, polled under the deadline)."""
        timeout = self.owner.timeout_s
        announce = {"kind": "layer", "request_id": t.request_id, "head_start": t.head_start, "layer": layers[0],
                    "count": len(layers)}
        self.control.send(announce, timeout)
        if not self._answer(t, "grant")["ok"]:
            self.owner.count("parts_rejected")
            return t.fail(f"receiver rejected {t.request_id}: unknown or cancelled request")
        for layer, (kv, event) in zip(layers, payloads):
            if t.checksum is not None:  # K then V of the part's tokens: what the receiver reads back
                t.checksum.update(kv, event)
            self.shared.write(layer, t.target, kv, event, t.head_start)
        self.shared.settle(timeout)
        self.control.send(announce | {"kind": "wrote"}, timeout)
        num_bytes = sum(kv.numel() * kv.element_size() for kv, _ in payloads)
        t.num_layers_sent += len(layers)
        t.num_bytes += num_bytes
        self.owner.count("bytes_sent", num_bytes)
        self.owner.count("layers_shared", len(layers))

    def _check_answer(self, msg: dict, kind: str, t: _Transfer) -> None:
        if msg["kind"] != kind or msg["request_id"] != t.request_id:
            raise TransferError(f"out-of-order answer {msg} (waiting for {kind} of {t.request_id})")

    def _connect(self, timeout: float) -> None:
        """The handshake, then the shared cache or the data channel."""
        o = self.owner
        welcome = self.control.call({"kind": "hello", "sender_id": o.sender_id, "compat": o.compat.to_dict(),
                                     "device_key": o.device_key}, timeout)
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
        if welcome["cache"] is not None and self._open_shared(welcome["cache"]):
            self.control.send({"kind": "join", "channel": welcome["channel"], "shared": True}, timeout)
            o.count("shared_connections")
            return
        try:
            store = dist.TCPStore(self.dest.host, welcome["store_port"], is_master=False,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=False)
            self.control.send({"kind": "join", "channel": welcome["channel"], "shared": False}, timeout)
            self.channel = open_channel(store, welcome["channel"], SENDER, o.device, o.host, timeout)
        except (RuntimeError, OSError) as exc:  # TCPStore / group rendezvous failures
            raise TransferError(f"building the data channel to {self.name} failed: {exc}") from None
        o.count("groups_created")

    def _open_shared(self, desc: dict) -> bool:
        """Opens the receiver's cache (same device); False, logged, when it cannot be opened here."""
        try:
            if desc.get("kind") == "cuda" and desc.get("pid") == os.getpid():
                raise ValueError("CUDA IPC cannot open a cache of this very process")
            self.shared = SharedCacheWriter(open_cache(desc, self.owner.device), int(desc["head_offset"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("same-device KV transport to %s unavailable (%s): using the data channel", self.name, exc)
            return False
        logger.info("KV to %s: written straight into its cache (same device)", self.name)
        return True


class TorchDistSender(KVSender):
    def __init__(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
                 max_groups: int = 64, same_device: bool = False):
        """`same_device`: write into the caches of receivers on this rank's device (they offer them)."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.compat, self.sender_id, self.timeout_s, self.host = compat, sender_id, timeout_s, host
        # the GPU whose KV this rank sends: current on the thread that builds the sender (the rank's)
        self.device = torch.device("cuda", torch.cuda.current_device()) if compat.device_type == "cuda" \
            else torch.device("cpu")
        self.device_key = device_key(self.device) if same_device else ""
        self.max_groups = max_groups
        self._peers: OrderedDict[tuple[str, int], _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._stats: Counter = Counter()
        self._closed = False
        self.recent_transfers: deque[dict] = deque(maxlen=1024)  # for benchmarks and debugging
        self.transfer_seconds = 0.0  # sum over acknowledged parts of (acked - begin)

    def begin(self, request_id: str, dest: KVEndpoint, head_start: int, head_end: int,
              num_tokens: int) -> Transfer:
        with self._lock:
            if self._closed:
                raise TransferError("sender is closed")
            peer = self._peers.get(dest.address)
            if peer is None:
                peer = self._peers[dest.address] = _Peer(self, dest)
                if len(self._peers) > self.max_groups:
                    _, old = self._peers.popitem(last=False)
                    old.close()  # finishes what it has queued, then destroys its group
                    self._stats["groups_evicted"] += 1
            self._peers.move_to_end(dest.address)
        return _Transfer(peer, request_id, head_start, head_end, num_tokens)

    def _drop(self, peer: _Peer) -> None:
        with self._lock:
            if self._peers.get(peer.dest.address) is peer:
                del self._peers[peer.dest.address]
            self._stats["groups_failed"] += 1
        peer.close()

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
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), OrderedDict()
        for p in peers:
            p.close()
