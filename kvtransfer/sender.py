"""The prefill side of the torch.distributed transport.

One `_Peer` per decode rank this prefill rank talks to, in an LRU pool of at most `max_groups`:
each owns a pair group (built lazily, on its own thread) and a queue of operations that its
thread sends in order, so the model keeps computing while layers leave. A peer that fails
(refused handshake, dead or silent receiver) fails its queued parts, destroys its group and
leaves the pool; the next `begin` to that address builds a fresh one.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kvtransfer import wire
from kvtransfer.base import IncompatiblePeerError, KVSender, Transfer, TransferError
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.torch_dist import RECEIVER, SENDER, destroy_group, make_pair_group, recv, send

logger = logging.getLogger(__name__)


class _Transfer(Transfer):
    def __init__(self, peer: _Peer, request_id: str, head_start: int, head_end: int, num_tokens: int):
        self.peer, self.request_id = peer, request_id
        self.head_start, self.head_end, self.num_tokens = head_start, head_end, num_tokens
        self.num_layers_sent = self.num_bytes = 0
        self.error: str | None = None
        self._done = threading.Event()
        # time.monotonic() stamps: begin, finish() called (first token known), acknowledged
        self.begin_s, self.finish_s, self.acked_s = time.monotonic(), None, None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        assert kv.shape[:3] == (2, self.num_tokens, self.head_end - self.head_start), kv.shape
        self.peer.submit(("layer", self, layer, kv))

    def finish(self, first_token: int, logprobs: dict[int, float] | None = None) -> None:
        self.finish_s = time.monotonic()
        self.peer.submit(("done", self, first_token, logprobs))

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
        self.pg: dist.ProcessGroup | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._ops: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"kv-send-{dest.host}:{dest.port}").start()

    def submit(self, op: tuple) -> None:
        with self._lock:
            if not self.closed:
                self._ops.put(op)
                return
        op[1].fail(f"connection to {self.dest.instance_id} rank {self.dest.rank} was closed")

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._ops.put(None)

    def _run(self) -> None:
        broken: str | None = None
        while (op := self._ops.get()) is not None:
            kind, transfer, a, b = op
            if broken is not None or transfer.error is not None:
                transfer.fail(transfer.error or broken)
                continue
            try:
                if self.pg is None:
                    self.pg = self._connect()
                self._send_layer(transfer, a, b) if kind == "layer" else self._finish(transfer, a, b)
            except Exception as exc:  # refused, timeout, peer gone: this connection is done for
                broken = str(exc) if isinstance(exc, IncompatiblePeerError) else (
                    f"KV connection to {self.dest.instance_id} rank {self.dest.rank} failed: {exc}")
                logger.warning("%s", broken)
                transfer.fail(broken)
                self.owner._drop(self)
        destroy_group(self.pg)

    def _connect(self) -> dist.ProcessGroup:
        o = self.owner
        timeout = timedelta(seconds=o.timeout_s)
        store = dist.TCPStore(self.dest.host, self.dest.port, is_master=False, timeout=timeout,
                              wait_for_workers=False)
        index = store.add("conn", 1) - 1
        store.set(f"hello/{index}", msgpack.packb({"sender_id": o.sender_id, "compat": o.compat.to_dict()}))
        store.wait([f"reply/{index}"], timeout)
        reply = msgpack.unpackb(store.get(f"reply/{index}"))
        if not reply["ok"]:
            raise IncompatiblePeerError(f"refused by {self.dest.instance_id} rank {self.dest.rank}: {reply['error']}")
        theirs = CompatRecord.from_dict(reply["compat"])
        if (diff := o.compat.mismatch(theirs)) is not None:
            raise IncompatiblePeerError(f"refused {self.dest.instance_id} rank {self.dest.rank}: {diff}")
        pg = make_pair_group(store, index, SENDER, o.compat.device_type, o.host, timeout)
        o._count("groups_created")
        return pg

    def _send_layer(self, t: _Transfer, layer: int, kv: torch.Tensor) -> None:
        msg = {"kind": "layer", "request_id": t.request_id, "layer": layer, "num_tokens": t.num_tokens,
               "head_start": t.head_start, "head_end": t.head_end}
        payload = kv.contiguous().view(-1).view(torch.uint8)
        send(self.pg, wire.encode_frame(msg, kv.device), RECEIVER)
        send(self.pg, payload, RECEIVER)
        t.num_layers_sent += 1
        t.num_bytes += payload.numel()
        self.owner._count("bytes_sent", payload.numel())

    def _finish(self, t: _Transfer, first_token: int, logprobs: dict[int, float] | None) -> None:
        msg = {"kind": "done", "request_id": t.request_id, "num_layers": t.num_layers_sent,
               "first_token": first_token, "logprobs": wire.pack_logprobs(logprobs)}
        device = "cuda" if self.owner.compat.device_type == "cuda" else "cpu"
        send(self.pg, wire.encode_frame(msg, device), RECEIVER)
        frame = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8, device=device)
        recv(self.pg, frame, RECEIVER)
        ack = wire.decode_frame(frame)
        if ack["kind"] != "ack" or ack["request_id"] != t.request_id:
            raise TransferError(f"out-of-order acknowledgement {ack}")
        if ack["ok"]:
            self.owner._count("parts_sent")
            t.succeed()
        else:  # the receiver is fine, this request is not (cancelled, shape mismatch)
            self.owner._count("parts_rejected")
            t.fail(f"receiver rejected {t.request_id}: {ack['error']}")


class TorchDistSender(KVSender):
    def __init__(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
                 max_groups: int = 64):
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.compat, self.sender_id, self.timeout_s, self.host = compat, sender_id, timeout_s, host
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

    def _count(self, key: str, n: int = 1) -> None:
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
