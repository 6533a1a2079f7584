"""The prefill side of the `nixl` KV transport: the decode rank reads the KV from this rank's pool.

The pool is registered with this rank's NIXL agent once (nixl_agent.py); each connection is the
torch transport's (sender.py `_Peer`: an LRU pool of connections, one thread and queue each,
deadlines, acks in order, a failed connection failing its parts and leaving the pool) with the
messages of nixl_wire.py: its hello carries the agent's metadata and the pool's shape, over the
authenticated control channel only (a receiver that cannot prove the cluster secret gets neither,
so it cannot read the pool); a part's `begin` names its tokens' slots here, each `layer` says
which layers the model has written (a CUDA event waited for first), and `done` comes after them.
Nothing is copied here: the request's blocks stay leased until the ack, which the receiver sends
once its reads landed (kvtransfer/connector.py: the lease). With `kv_checksum`, `done` carries a
checksum of the part read back from the pool (nixl_wire.py), the one cost on this side.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import BLOCK_LAYOUTS
from kvtransfer import wire
from kvtransfer.base import KVPool
from kvtransfer.nixl_agent import make_agent, register
from kvtransfer.nixl_reads import PoolShape
from kvtransfer.nixl_wire import NIXL_SCHEMA, encode_runs
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.scatter import gather_tokens, slot_runs
from kvtransfer.sender import TorchDistSender, _Peer, _Transfer

logger = logging.getLogger(__name__)


class _NixlTransfer(_Transfer):
    def __init__(self, peer: _NixlPeer, request_id: str, head_start: int, head_end: int, num_tokens: int,
                 slots: torch.Tensor, trace: str = ""):
        super().__init__(peer, request_id, head_start, head_end, num_tokens, trace)
        assert slots is not None and slots.numel() == num_tokens, (num_tokens, slots)
        self.slots = slots
        self.layers: list[int] = []  # announced, in order

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        raise NotImplementedError("the nixl transport's receivers read the pool: layer_ready")

    def layer_ready(self, layer: int) -> None:
        ready = None
        if self.slots.is_cuda:  # written on the compute stream: announced once the event passed
            ready = torch.cuda.Event()
            ready.record()
        self.peer.submit(("layer", self, layer, ready))


class _NixlPeer(_Peer):
    """The connection to one decode rank, which reads this rank's pool."""

    def __init__(self, owner: NixlSender, dest: KVEndpoint):
        self.joined = False  # the handshake passed (before the thread starts)
        super().__init__(owner, dest)

    def _carry_out(self, kind: str, t: _NixlTransfer, a, b) -> None:
        timeout = self.owner.timeout_s
        if not self.joined:
            self._connect(timeout)
        if not t.begun:
            source = encode_runs(np.array([(slot, n) for _, n, slot in slot_runs(t.slots.to("cpu", torch.int64))],
                                          dtype=np.int64).reshape(-1, 2))
            self.control.send({"kind": "begin", "request_id": t.request_id, "head_start": t.head_start,
                               "head_end": t.head_end, "num_tokens": t.num_tokens, "source": source,
                               "trace": t.trace}, timeout)
            ready = self._answer(t)
            if not ready["ok"]:  # the receiver is fine, this request is not (cancelled, wrong size)
                self.owner.count("parts_rejected")
                return t.fail(f"receiver rejected {t.request_id}: {ready['error']}")
            t.begun = True
        if kind == "layer":
            return self._announce(t, *self._gather(t, a, b))
        for msg in wire.trailer_messages(t.request_id, t.head_start, a):
            self.control.send(msg, timeout)
            self.owner.count("trailer_bytes_sent", len(msg["data"]))
        checksum = None if t.checksum is None else self.owner.checksum(t)
        self.control.send({"kind": "done", "request_id": t.request_id, "head_start": t.head_start,
                           "num_layers": t.num_layers_sent, "trailer_bytes": len(a), "checksum": checksum,
                           "mac": None}, timeout)
        t.posted_before_done = self.posted
        self.unacked.append(t)

    def _announce(self, t: _NixlTransfer, layers: list[int], events: list) -> None:
        """`layer` for layers the model wrote (consecutive ones in one message)."""
        if events[-1] is not None:  # one stream: the last event passed means every one did
            events[-1].synchronize()
        self.control.send({"kind": "layer", "request_id": t.request_id, "head_start": t.head_start,
                           "layer": layers[0], "count": len(layers)}, self.owner.timeout_s)
        o = self.owner
        num_bytes = len(layers) * wire.payload_bytes(t.num_tokens, t.head_end - t.head_start, o.compat.head_dim,
                                                     o.pool.cache.dtype)
        t.num_layers_sent += len(layers)
        t.layers += layers
        t.num_bytes += num_bytes
        self.owner.count("bytes_sent", num_bytes)

    def _connect(self, timeout: float) -> None:
        """The handshake: the agent's metadata and the pool's shape go to this receiver only."""
        self._hello({"agent": self.owner.metadata, "pool": self.owner.shape.to_dict()}, timeout)
        self.joined = True
        self.owner.count("groups_created")


class NixlSender(TorchDistSender):
    pulls = True
    peer_class = _NixlPeer
    schema = NIXL_SCHEMA

    def __init__(self, compat: CompatRecord, sender_id: str, pool: KVPool, timeout_s: float = 10.0,
                 host: str = "127.0.0.1", max_groups: int = 64):
        """`pool`: this rank's KV pool, registered here for its receivers to read."""
        super().__init__(compat, sender_id, timeout_s, host, max_groups, same_device=False)
        self.pool, self.views = pool, BLOCK_LAYOUTS[pool.layout].views
        self.shape = PoolShape.of(pool.cache, pool.layout, pool.head_offset)
        self.agent = make_agent("prefill", progress=True)
        self._registered = register(self.agent, pool.cache)
        self.metadata = self.agent.get_agent_metadata()
        logger.info("KV sender %s: pool of %.0f MiB registered with NIXL (%s), read by its receivers", sender_id,
                    pool.cache.nbytes / 2**20, self.shape.mem)

    def begin(self, request_id: str, dest: KVEndpoint, head_start: int, head_end: int, num_tokens: int,
              slots: torch.Tensor | None = None, trace: str = "") -> _NixlTransfer:
        return _NixlTransfer(self._peer(dest), request_id, head_start, head_end, num_tokens, slots, trace)

    def checksum(self, t: _NixlTransfer) -> int:
        """The part's checksum read back from the pool (nixl_wire.py): every layer it announced."""
        lo = t.head_start - self.pool.head_offset
        slots = t.slots.to(self.pool.cache.device)
        for layer in t.layers:
            kv = gather_tokens(self.views(self.pool.cache[layer]), slots, self.shape.block_size)
            t.checksum.update(kv[:, :, lo:lo + t.head_end - t.head_start])
        return t.checksum.value

    def close(self) -> None:
        super().close()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:  # already torn down with its agent
            logger.debug("NIXL deregistration: %s", exc)
