"""The decode side of the torch.distributed transport.

A listener thread accepts connections announced in this rank's TCPStore (handshake: see
torch_dist.py); one reader thread per connection receives frames and scatters each layer's KV
straight into the slots reserved for its request. Requests are tracked in `_Expected`:

    expect(rid, slots, num_parts) -> layers arrive (any order across parts) -> every part "done"
      -> poll() reports (rid, first_token, logprobs);  silent for timeout_s once started -> poll() reports failure

Garbage frames close their connection (the stream cannot be resynchronized; the sender rebuilds
it); frames for unknown ids are drained and dropped. Both are counted. A started part fails when
neither it nor its connection has moved for timeout_s (a long queue of other requests' KV on the
same connection is not a dead sender).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kvtransfer import wire
from kvtransfer.base import CompletedTransfer, KVReceiver
from kvtransfer.params import CompatRecord
from kvtransfer.torch_dist import RECEIVER, SENDER, destroy_group, make_pair_group, recv, send

logger = logging.getLogger(__name__)
# A reader blocks on the next frame for as long as its sender stays idle; liveness is judged per
# request (timeout_s after its first layer), not per connection.
IDLE_CONNECTION_TIMEOUT = timedelta(days=7)


@dataclass
class _Expected:
    slots: torch.Tensor  # (num_tokens,) int64
    num_parts: int
    block_ids: torch.Tensor | None  # (num_tokens // block_size,) when the slots fill whole blocks in order
    layers_per_part: Counter = field(default_factory=Counter)  # (connection, head_start) -> layers
    parts_done: int = 0
    first_token: int = -1
    logprobs: dict[int, float] | None = None
    last_activity: float | None = None  # set by the first layer


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
        self._expected: dict[str, _Expected] = {}
        self._completed: list[CompletedTransfer] = []
        self._failed: list[tuple[str, str]] = []
        self._stats: Counter = Counter()
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._conn_activity: dict[int, float] = {}  # connection -> time.monotonic() of its last frame
        self._closed = threading.Event()
        threading.Thread(target=self._listen, daemon=True, name=f"kv-listen-{self._store.port}").start()

    @property
    def endpoint_address(self) -> tuple[str, int]:
        return self.host, self._store.port

    # -- KVReceiver API -------------------------------------------------------------------------
    def expect(self, request_id: str, slots: torch.Tensor, num_parts: int) -> None:
        assert slots.dim() == 1 and num_parts >= 1
        slots = slots.to(self.kv_cache.device, torch.int64)
        with self._lock:
            self._expected[request_id] = _Expected(slots, num_parts, _whole_blocks(slots, self.block_size))

    def cancel(self, request_id: str) -> None:
        with self._lock:  # a reader scatters under this lock, so no write lands after we return
            self._expected.pop(request_id, None)

    def poll(self) -> tuple[list[CompletedTransfer], list[tuple[str, str]]]:
        now = time.monotonic()
        with self._lock:
            for rid, e in list(self._expected.items()):
                if e.last_activity is None:
                    continue
                # A connection busy with other requests' KV is alive: this part waits in its queue.
                busy = max((self._conn_activity.get(i, 0.0) for i, _ in e.layers_per_part), default=0.0)
                if now - max(e.last_activity, busy) > self.timeout_s:
                    self._fail(rid, f"no KV for {self.timeout_s:.0f} s after the transfer began")
            done, self._completed = self._completed, []
            failed, self._failed = self._failed, []
        return done, failed

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for pg in groups:
            destroy_group(pg)

    # -- internals (callers hold self._lock where noted) ---------------------------------------
    def _fail(self, rid: str, reason: str) -> None:
        """Holding the lock."""
        if self._expected.pop(rid, None) is not None:
            self._failed.append((rid, reason))
            self._stats["failed"] += 1

    def _listen(self) -> None:
        """Accepts connections in the order senders numbered them."""
        index, seen_at = 0, None
        while not self._closed.is_set():
            try:
                if index >= self._store.add("conn", 0):
                    time.sleep(0.01)
                    continue
                if not self._store.check([f"hello/{index}"]):
                    seen_at = seen_at or time.monotonic()
                    if time.monotonic() - seen_at > self.timeout_s:  # sender died mid-handshake
                        index, seen_at = index + 1, None
                    time.sleep(0.005)
                    continue
                self._accept(index)
            except Exception:  # a bad hello must not stop the listener
                logger.exception("KV listener: connection %d", index)
            index, seen_at = index + 1, None

    def _accept(self, index: int) -> None:
        reply = {"ok": False, "error": None, "compat": self.compat.to_dict()}
        try:
            hello = msgpack.unpackb(self._store.get(f"hello/{index}"))
            theirs = CompatRecord.from_dict(hello["compat"])
            sender_id = str(hello["sender_id"])
            reply["error"] = self.compat.mismatch(theirs)
        except Exception as exc:
            sender_id, reply["error"] = "?", f"malformed hello: {exc}"
        reply["ok"] = reply["error"] is None
        self._store.set(f"reply/{index}", msgpack.packb(reply))
        if not reply["ok"]:
            logger.warning("refused KV sender %s: %s", sender_id, reply["error"])
            with self._lock:
                self._stats["refused_peers"] += 1
            return
        threading.Thread(target=self._serve, args=(index, sender_id), daemon=True,
                         name=f"kv-recv-{index}").start()

    def _serve(self, index: int, sender_id: str) -> None:
        """One connection's reader; ends when the sender goes away or sends garbage."""
        device = self.kv_cache.device
        pg = make_pair_group(self._store, index, RECEIVER, self.compat.device_type, self.host,
                             IDLE_CONNECTION_TIMEOUT)
        with self._lock:
            self._groups[index] = pg
            self._stats["connections"] += 1
        frame = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8, device=device)
        scratch = torch.empty(0, dtype=torch.uint8, device=device)
        try:
            while not self._closed.is_set():
                recv(pg, frame, SENDER)
                self._conn_activity[index] = time.monotonic()
                msg = self._validated(wire.decode_frame(frame))
                if msg["kind"] == "layer":
                    n = wire.payload_bytes(msg, self.compat.head_dim, self.kv_cache.dtype)
                    if scratch.numel() < n:
                        scratch = torch.empty(n, dtype=torch.uint8, device=device)
                    recv(pg, scratch[:n], SENDER)
                    self._on_layer(index, msg, scratch[:n])
                else:
                    ok, error = self._on_done(index, msg)
                    ack = {"kind": "ack", "request_id": msg["request_id"], "ok": ok, "error": error}
                    send(pg, wire.encode_frame(ack, device), SENDER)
        except wire.WireError as exc:
            logger.warning("KV connection %d from %s: garbage frame dropped, closing: %s", index, sender_id, exc)
            with self._lock:
                self._stats["garbage_headers"] += 1
        except Exception as exc:  # sender gone or group aborted by close()
            if not self._closed.is_set():
                logger.warning("KV connection %d from %s closed: %s", index, sender_id, exc)
        with self._lock:
            self._groups.pop(index, None)
            self._conn_activity.pop(index, None)
            for rid in [r for r, e in self._expected.items() if any(k[0] == index for k in e.layers_per_part)]:
                if self._expected[rid].parts_done < self._expected[rid].num_parts:
                    self._fail(rid, f"connection from {sender_id} closed mid-transfer")
        destroy_group(pg)

    def _validated(self, msg: dict) -> dict:
        """Rejects messages that do not fit this rank (as garbage: the stream is suspect)."""
        if msg["kind"] == "ack":
            raise wire.WireError("ack sent to a receiver")
        if msg["kind"] == "layer":
            lo, hi = msg["head_start"] - self.head_offset, msg["head_end"] - self.head_offset
            if not (0 <= msg["layer"] < self.compat.num_layers and 0 <= lo < hi <= self.num_local_heads
                    and 0 < msg["num_tokens"] <= self.num_slots):
                raise wire.WireError(f"layer message does not fit this rank: {msg}")
        return msg

    def _on_layer(self, index: int, msg: dict, payload: torch.Tensor) -> None:
        n_heads = msg["head_end"] - msg["head_start"]
        kv = payload.view(self.kv_cache.dtype).view(2, msg["num_tokens"], n_heads, self.compat.head_dim)
        lo = msg["head_start"] - self.head_offset
        with self._lock:
            self._stats["bytes_received"] += payload.numel()
            e = self._expected.get(msg["request_id"])
            if e is None:
                self._stats["unknown_requests"] += 1
                return
            if msg["num_tokens"] != e.slots.numel():
                self._fail(msg["request_id"], f"sent {msg['num_tokens']} tokens, expected {e.slots.numel()}")
                return
            self._scatter(self.kv_cache[msg["layer"]], e, kv, lo)
            e.layers_per_part[(index, msg["head_start"])] += 1
            e.last_activity = time.monotonic()

    def _scatter(self, layer: torch.Tensor, e: _Expected, kv: torch.Tensor, lo: int) -> None:
        """Writes kv (2, num_tokens, n_heads, head_dim) into the request's slots of one layer
        (2, num_blocks, block_size, local_kv_heads, head_dim). Holding the lock.

        Fast path (a part with all of this rank's heads, the usual case): whole blocks are copied as
        rows of 4-byte words, 3-4x faster than per-token indexing of 2-byte elements here."""
        if lo != 0 or kv.shape[2] != self.num_local_heads:
            flat = layer.view(2, self.num_slots, self.num_local_heads, self.compat.head_dim)
            flat[:, e.slots, lo:lo + kv.shape[2]] = kv
            return
        n_full = 0 if e.block_ids is None else e.block_ids.numel() * self.block_size
        if n_full:  # (2, blocks, block_size * heads * head_dim) as wide words
            dst = _words(layer.view(2, layer.shape[1], -1))
            dst.index_copy_(1, e.block_ids, _words(kv[:, :n_full].reshape(2, e.block_ids.numel(), -1)))
        if n_full < kv.shape[1]:  # the rest token by token: (2, slots, heads * head_dim)
            _words(layer.view(2, self.num_slots, -1)).index_copy_(1, e.slots[n_full:],
                                                                  _words(kv[:, n_full:].reshape(2, kv.shape[1] - n_full, -1)))

    def _on_done(self, index: int, msg: dict) -> tuple[bool, str | None]:
        rid = msg["request_id"]
        with self._lock:
            e = self._expected.get(rid)
            if e is None:
                self._stats["unknown_requests"] += 1
                return False, "unknown or cancelled request"
            got = sum(n for (i, _), n in e.layers_per_part.items() if i == index)
            if got != msg["num_layers"] or got != self.compat.num_layers:
                self._fail(rid, f"part has {got} of {self.compat.num_layers} layers")
                return False, f"received {got} of {self.compat.num_layers} layers"
            e.parts_done += 1
            e.first_token = max(e.first_token, msg["first_token"])
            if msg["logprobs"] is not None:
                e.logprobs = wire.unpack_logprobs(msg["logprobs"])
            if e.parts_done == e.num_parts:
                del self._expected[rid]
                if self.kv_cache.is_cuda:
                    torch.cuda.current_stream().synchronize()
                self._completed.append(CompletedTransfer(rid, e.first_token, e.logprobs))
                self._stats["completed"] += 1
        return True, None


def _whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if the leading full blocks' worth of slots are whole blocks in order, else None.

        slots  [b0*bs .. b0*bs+bs-1 | b1*bs .. b1*bs+bs-1 | ... | tail (< bs)]  ->  [b0, b1, ...]
    """
    n = slots.numel() // block_size
    if n == 0:
        return None
    head = slots[:n * block_size].view(n, block_size)
    starts = head[:, 0]
    if bool((starts % block_size == 0).all()) and torch.equal(head, starts[:, None] + torch.arange(
            block_size, device=slots.device)):
        return starts // block_size
    return None


def _words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as 4-byte words when rows allow it (index_copy_ moves wide elements faster)."""
    if t.element_size() < 4 and (t.shape[-1] * t.element_size()) % 4 == 0:
        return t.view(torch.int32)
    return t
