"""The decode side of the KV connector's transport.

A control server (control.py) accepts one connection per prefill rank; each gets a `Session`
(session.py) that answers its messages (wire.py) in order and owns its data channel (channel.py):

    hello -> compat checked -> welcome          join  -> data channel built
    begin -> the request's slots are reserved here? -> ready (ok, or why not; the runs)
    layer -> receive exactly that payload (deadline): straight into the cache when the part has
             all of this rank's heads and its slots form at most MAX_DIRECT_RUNS stretches,
             else into a buffer, then scattered into the request's slots
    trailer -> kept with its part (bytes carried unread: base.py)
    done  -> all layers there? -> ack;  every part of the request done -> poll() reports it

Requests are tracked in `Expected`: expect(rid, slots, num_parts) ... poll() reports
(rid, the trailer a part carried), or a failure: a begun part silent for timeout_s (unless its
connection is busy with other requests' KV), a connection lost mid-part, a part of the wrong
size. A garbage message or a receive past its deadline drops its connection (the sender
rebuilds it); payloads of a cancelled request are received and dropped. All of it is counted.
A cancel waits for a receive in flight into the request's slots (at most its deadline), so no
byte lands in blocks that may have moved on.

Same device (`share_cache`, shared_cache.py): a sender that opened this cache writes a part's
layers into its slots itself; its `ready` is a grant of the part's slots until its `done`
(counted like a receive in flight, so a cancel waits for that `done`), and a grant not ended
within timeout_s drops the connection. A sender on this device that is not offered the cache
(why is in the welcome, and logged here) gets the host data channel, never NCCL
(channel.py: data_channel_kind).

Authentication (control.py, wire.py): a connection gets a `Session` only once its peer proved
the cluster secret; one that does not, or whose message's MAC is wrong, is closed and counted
(`auth_refused` in stats), and nothing it sent reaches a session or the cache.

Data channels (rendezvous.py): each connection's hello (after the handshake) makes a store of
its own on this rank's host, under a random prefix the welcome carries; the channel is built on
it at `join` and the store stops at the sender's first `begin`, once both ends are (NCCL, which
bootstraps at its first operation: when the channel closes). No store of this rank listens beyond
that, nor on another address.

Payload MACs (wire.py PartMac): on an authenticated connection with a data channel, `done`
carries the sender's MAC of the part's payloads, keyed from the connection's session key; the
session's own over what arrived must equal it before the request can be reported complete (so
before it becomes runnable), or the part fails like a checksum mismatch (the request reported
failed, its blocks freed by the instance), logged and counted (`kv_mac_mismatches`).

Checksums (`compat.kv_checksum`, wire.py): `done` carries the sender's checksum of the part;
the session's own over what arrived must equal it, or the part fails like one from a lost peer
(ack {ok: false}, the request reported failed), logged and counted (`kv_checksum_mismatches`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import torch

from engine.core.threads import run_serially
from kvtransfer import wire
from kvtransfer.base import CompletedTransfer, KVReceiver
from kvtransfer.channel import RECEIVER, DataChannel, data_channel_kind
from kvtransfer.channel_factory import open_channel
from kvtransfer.wire import PartChecksum
from kvtransfer.control import ControlGarbage, ControlServer
from kvtransfer.params import CompatRecord
from kvtransfer.rendezvous import Rendezvous
from kvtransfer.scatter import scatter_layer, scatter_tokens, slot_runs, whole_blocks
from kvtransfer.session import Expected, Part, Session
from kvtransfer.shared_cache import device_key, export_cache

logger = logging.getLogger(__name__)
# Each run costs two messages per layer (K, V); beyond this many, one message and a scatter is faster.
MAX_DIRECT_RUNS = 4


class TorchDistReceiver(KVReceiver):
    schema = wire.SCHEMA  # of its control messages

    def __init__(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int, host: str = "127.0.0.1",
                 timeout_s: float = 10.0, share_cache: bool = False, kv_views=None, *, control_auth: bool = True,
                 payload_mac: bool = True):
        """`share_cache`: offer senders on the same device (shared_cache.device_key) the cache
        itself, so they write into it (on a CPU it moves into shared memory). `kv_views`: the
        attention backend's, where the blocks are not in the torch layout: every layer is then
        scattered through them (no direct receives, no shared cache). `control_auth=False`: an
        unauthenticated control channel (control.py), for bench/kv_transfer.py's comparison only
        (TorchDistTransport never passes it), which has no payload MACs either; `payload_mac=False`:
        none on an authenticated channel, for the same benchmark only."""
        self.kv_views, self.payload_mac = kv_views, payload_mac and control_auth
        # kv_cache: (num_layers, 2, num_blocks, block_size, local_kv_heads, head_dim)
        assert kv_cache.dim() == 6 and kv_cache.shape[0] == compat.num_layers, kv_cache.shape
        self.compat, self.kv_cache, self.head_offset = compat, kv_cache, head_offset
        self.num_local_heads, self.timeout_s, self.host = kv_cache.shape[4], timeout_s, host
        self.block_size = kv_cache.shape[3]
        self.num_slots = kv_cache.shape[2] * self.block_size
        self._lock = threading.Lock()
        self._receives_done = threading.Condition(self._lock)
        self._expected: dict[str, Expected] = {}
        self._completed: list[CompletedTransfer] = []
        self._failed: list[tuple[str, str]] = []
        self._stats: Counter = Counter()
        self._sessions: set[Session] = set()
        self.device_key = device_key(kv_cache.device)  # whether a sender is on this device, shared or not
        self.shared_cache, self.no_cache_reason = self._share(share_cache)
        self._closed = False
        self._control = ControlServer(host, self._open_session, self.schema, authenticate=control_auth,
                                      session_keys=True)

    def _share(self, share_cache: bool) -> tuple[dict | None, str | None]:
        """The cache's description for senders on this device, or why there is none (logged)."""
        if not share_cache:
            return None, "cache sharing is off on this rank (kv_transport torch, or a backend's own KV layout)"
        why = None
        if self.kv_views is not None:
            why = "the attention backend lays out its own KV blocks (kv_views); same-device writes use torch's layout"
        elif not self.device_key:
            why = "this host cannot tell devices apart (no /proc)"
        else:
            try:
                desc = export_cache(self.kv_cache, self.head_offset)
                logger.info("KV receiver: senders on this device write into this cache")
                return desc, None
            except ValueError as exc:
                why = str(exc)
        logger.warning("KV receiver: same-device transport off (%s): senders on this device use the data channel", why)
        return None, why

    def _open_session(self, drop, session_key: bytes | None) -> Session:
        """On the connection's own thread, which scatters what arrives: its tensor ops run
        serially, so it starts no OpenMP team beside the step thread's (engine/core/threads.py)."""
        run_serially()
        return Session(self, drop, wire.payload_key(session_key) if self.payload_mac and session_key else None)

    @property
    def endpoint_address(self) -> tuple[str, int]:
        return self._control.address

    # -- KVReceiver API -------------------------------------------------------------------------
    def expect(self, request_id: str, slots: torch.Tensor, num_parts: int) -> None:
        assert slots.dim() == 1 and num_parts >= 1
        host = slots.to("cpu", torch.int64)  # the layout is worked out on the host: no device sync
        blocks = whole_blocks(host, self.block_size)
        e = Expected(host.to(self.kv_cache.device), num_parts,
                     None if blocks is None else blocks.to(self.kv_cache.device), slot_runs(host), host_slots=host)
        with self._lock:
            self._expected[request_id] = e

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
            # slots granted to a sender on this device and not written back in time: it is stuck
            stalled |= {s for s in self._sessions if s.granted_since() < now - self.timeout_s}
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
        out["control_messages"] = self._control.stats["messages"]
        out["auth_refused"] = self._control.stats["auth_refused"]
        return out

    def close(self) -> None:
        self._control.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions), set()
        for session in sessions:
            if session.channel is not None:
                session.channel.close()
            session.end_rendezvous()
        with self._lock:
            self._closed = True

    # -- the sessions' calls -----------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _fail(self, rid: str, reason: str) -> None:
        """Holding the lock."""
        if self._expected.pop(rid, None) is not None:
            self._failed.append((rid, reason))
            self._stats["failed"] += 1

    def on_hello(self, session: Session, msg: dict) -> dict:
        reply = {"kind": "welcome", "ok": False, "error": None, "compat": self.compat.to_dict(),
                 "store_port": 0, "store_prefix": "", "channel": -1, "cache": None, "data_channel": "gloo",
                 "no_cache_reason": None}
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
        same_device = bool(self.device_key) and msg["device_key"] == self.device_key
        session.data_channel = reply["data_channel"] = data_channel_kind(self.compat.device_type, same_device)
        if same_device and self.shared_cache is not None:
            session.offered = True  # the sender may open the cache and join shared
            reply["cache"] = self.shared_cache
        elif same_device:
            reply["no_cache_reason"] = self.no_cache_reason
            logger.info("KV from %s (this device): no cache offered (%s): data channel %s", session.sender_id,
                        self.no_cache_reason, reply["data_channel"])
        session.rendezvous = Rendezvous(self.host, self.timeout_s)  # its store, until `join` (or the connection) ends
        reply["store_port"], reply["store_prefix"] = session.rendezvous.port, session.rendezvous.prefix
        reply["ok"] = True
        return reply

    def open_data_channel(self, session: Session) -> DataChannel:
        """This end of `session`'s data channel, of the kind its welcome named, built in its
        rendezvous store (rendezvous.py). The store stops at the sender's first `begin`, which it
        sends once its own end is built (the session's), or here if this end fails; NCCL keeps
        it until the channel closes."""
        with self._lock:
            if self._closed:
                raise ControlGarbage("the receiver is closed")
        if session.rendezvous is None:
            raise ControlGarbage("join without a rendezvous")
        try:
            channel = open_channel(session.rendezvous.store(), RECEIVER, session.data_channel, self.kv_cache.device,
                                   self.host, self.timeout_s)
        except (RuntimeError, OSError) as exc:  # the sender did not join in time
            session.end_rendezvous()
            raise ControlGarbage(f"data channel {session.index} was not built: {exc}") from None
        return channel

    def on_begin(self, session: Session, msg: dict) -> dict:
        rid, lo = msg["request_id"], msg["head_start"] - self.head_offset
        reply = {"kind": "ready", "request_id": rid, "ok": False, "error": None, "runs": [], "slots": []}
        n_heads = msg["head_end"] - msg["head_start"]
        if not (0 <= lo and 0 < n_heads and lo + n_heads <= self.num_local_heads and msg["num_tokens"] > 0):
            raise ControlGarbage(f"begin does not fit this rank: {msg}")
        with self._lock:
            if (e := self._begun(msg, reply)) is not None:
                direct = session.shared or (self.kv_views is None and lo == 0 and n_heads == self.num_local_heads
                                            and len(e.runs) <= MAX_DIRECT_RUNS)
                part = Part(lo, n_heads, msg["num_tokens"], e.runs if direct else [],
                            checksum=PartChecksum() if self.compat.kv_checksum else None,
                            mac=session.part_mac(rid, msg["head_start"], msg["num_tokens"]))
                session.parts[(rid, msg["head_start"])] = part
                if session.shared:  # the part's slots are the sender's to write until its `done`
                    e.receiving += 1
                    session.granted[(rid, msg["head_start"])] = (part, e, time.monotonic())
                e.sessions.add(session)
                e.last_activity = time.monotonic()
                reply["ok"] = True
                reply["runs"] = [[start, length] for start, length, _ in part.runs]
                reply["slots"] = [slot for *_, slot in part.runs] if session.shared else []
        return reply

    def _begun(self, msg: dict, reply: dict) -> Expected | None:
        """Holding the lock: the Expected a `begin` names, or None with `reply["error"]` saying why
        (not reserved here, or of another size: that fails the request)."""
        e = self._expected.get(msg["request_id"])
        if e is None:
            self._stats["unknown_requests"] += 1
            reply["error"] = "unknown or cancelled request"
        elif msg["num_tokens"] != e.slots.numel():
            reply["error"] = f"sent {msg['num_tokens']} tokens, expected {e.slots.numel()}"
            self._fail(msg["request_id"], reply["error"])
            e = None
        elif not e.began_ns:
            e.trace, e.began_ns = msg["trace"], time.time_ns()
        return e

    def start_receiving(self, rid: str) -> Expected | None:
        """A receive straight into the request's slots starts: its Expected (None: it is gone)."""
        with self._lock:
            if (e := self._expected.get(rid)) is not None:
                e.receiving += 1
            return e

    def on_received(self, rid: str, part: Part, e: Expected | None, layers: int, num_bytes: int) -> None:
        """Ends what `start_receiving` began (e: what it returned): `layers` of the part landed."""
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

    def write_part(self, session: Session, rid: str, layer: int, part: Part, payload: torch.Tensor) -> None:
        kv = payload.view(self.kv_cache.dtype).view(2, part.num_tokens, part.num_heads, self.compat.head_dim)
        with self._lock:
            self._stats["bytes_received"] += payload.numel()
            e = self._expected.get(rid)
            if e is None:  # cancelled or failed meanwhile: the payload is dropped
                self._stats["dropped_layers"] += 1
                return
            with session.channel.writing():
                if self.kv_views is None:
                    scatter_layer(self.kv_cache[layer], e.slots, e.block_ids, kv, part.lo)
                else:
                    scatter_tokens(self.kv_views(self.kv_cache[layer]), e.slots, self.block_size, kv, part.lo)
            part.layers += 1
            self._stats["layers_scattered"] += 1
            e.last_activity = time.monotonic()

    def on_done(self, session: Session, msg: dict, part: Part) -> dict:
        rid = msg["request_id"]
        reply = {"kind": "ack", "request_id": rid, "ok": False, "error": None}
        if session.channel is not None:  # CUDA: this part's writes are done before admission
            session.channel.settle(self.timeout_s)
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
            if part.checksum is not None and part.checksum.value != msg["checksum"]:
                reply["error"] = (f"KV checksum mismatch: received {part.checksum.value:016x}, "
                                  f"sent {msg['checksum']:016x}")
                logger.warning("KV from %s: %s of %s (heads from %d)", session.sender_id, reply["error"], rid,
                               msg["head_start"])
                self._stats["kv_checksum_mismatches"] += 1
                self._fail(rid, reply["error"])
                return reply
            if part.mac is not None and not part.mac.verify(msg["mac"]):
                reply["error"] = "KV payload MAC mismatch: bytes altered or injected on the data channel"
                logger.warning("KV from %s: %s of %s (heads from %d): dropped", session.sender_id, reply["error"], rid,
                               msg["head_start"])
                self._stats["kv_mac_mismatches"] += 1
                self._fail(rid, reply["error"])
                return reply
            if part.trailer and e.trailer:
                reply["error"] = "a second part carried a trailer"
                self._fail(rid, reply["error"])
                return reply
            e.parts_done += 1
            if part.trailer:
                e.trailer = b"".join(part.trailer)
            if e.parts_done == e.num_parts:
                del self._expected[rid]
                self._completed.append(CompletedTransfer(rid, e.trailer, e.trace, e.began_ns))
                self._stats["completed"] += 1
        reply["ok"] = True
        return reply

    def on_session_closed(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)
            for rid, _ in session.parts:
                self._fail(rid, f"connection from {session.sender_id} closed mid-transfer")
            for e in self._expected.values():
                e.sessions.discard(session)
