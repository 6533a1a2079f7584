"""Fault injection for the KV transport: a proxy on the control channel, and a data plane that
corrupts payloads in flight.

`FaultProxy`: in front of a KV receiver's control port (the data channel goes direct: its
rendezvous address comes in the receiver's welcome).

It parses the sender's msgpack stream (the authentication handshake, then frames whose body
is a message: kvtransfer/control.py) and forwards it unchanged, so a fault can start at a given
message kind:

    proxy = FaultProxy(rx.endpoint_address)
    proxy.blackhole_from = "begin"   # from the first begin on, nothing passes either way (a peer
                                     # that stops answering, its TCP connection still open)
    proxy.delay_s = 0.05             # every message waits this long, both ways
    proxy.garbage_at = "layer"       # that message is replaced by bytes that are not msgpack

`corrupt_in_flight(layer: int = 1, times: int = 1)`: a context manager; while it is active, the
next `times` KV parts any sender of this process sends over a data channel (gloo, NCCL: patched
at the class level) carry ONE altered element: K of layer `layer`, the part's first token, its
first head, dim 0, plus OFFSET (8.0), in the message on the wire only. The sender's cache and
the tensor it hands to the channel (and so its checksum) are untouched; the decode instance
reads that element in every attention of layer `layer`. It yields an `InFlightCorruption`
whose `.altered` lists what it changed (`Altered`: request id, head_start, layer, token, the
value before and after), so a test can assert it fired. Same-device connections (written into
the decode cache, no data channel) are not corrupted.

    with corrupt_in_flight(layer=1, times=1) as fault:
        streams = cluster.generate(prompts, params)
    assert len(fault.altered) == 1
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import NamedTuple
from unittest import mock

import msgpack
import torch

from kvtransfer.channel import GlooChannel
from kvtransfer.nccl import NcclChannel
from kvtransfer.params import KVEndpoint
from kvtransfer.sender import _Peer

OFFSET = 8.0  # added to the altered element: far outside a layer's K values, so the output changes


class FaultProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.blackhole_from: str | None = None
        self.garbage_at: str | None = None
        self.delay_s = 0.0
        self.seen: list[str] = []  # kinds of the sender's messages, in order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def endpoint(self, instance_id: str = "d", rank: int = 0) -> KVEndpoint:
        return KVEndpoint(instance_id, rank, *self._listener.getsockname()[:2])

    def heal(self) -> None:
        """Faults off; connections that were black-holed stay so (as after a real partition,
        the sender rebuilds them)."""
        self.blackhole_from = self.garbage_at = None
        self.delay_s = 0.0

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            state = {"holed": False}
            threading.Thread(target=self._pump, args=(client, server, state, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, state, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, from_sender: bool) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        try:
            while data := src.recv(65536):
                if not from_sender:
                    self._forward(dst, data, state)
                    continue
                unpacker.feed(data)
                for msg in unpacker:
                    kind = _kind(msg)
                    self.seen.append(kind)
                    if kind == self.blackhole_from:
                        state["holed"] = True
                    raw = b"\xc1\xc1\xc1\xc1" if kind == self.garbage_at else msgpack.packb(msg)
                    self._forward(dst, raw, state)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forward(self, dst: socket.socket, data: bytes, state: dict) -> None:
        if state["holed"]:
            return
        if self.delay_s:
            time.sleep(self.delay_s)
        dst.sendall(data)


def _kind(obj) -> str:
    """The kind of the message a frame [seq, body, mac] carries; "?" for the handshake's arrays."""
    if isinstance(obj, list) and len(obj) == 3 and isinstance(obj[1], bytes):
        obj = msgpack.unpackb(obj[1], raw=False)
    return obj.get("kind", "?") if isinstance(obj, dict) else "?"


class Altered(NamedTuple):
    request_id: str  # the transfer's id (an attempt id in a cluster: "<request>#<attempt>")
    head_start: int  # the part's first head: the altered one
    layer: int
    token: int  # within the part (logical order)
    before: float
    after: float


class InFlightCorruption:
    """The state of one `corrupt_in_flight`: which parts to alter, and what it altered."""

    def __init__(self, layer: int, times: int):
        assert layer >= 0 and times >= 1, (layer, times)
        self.layer, self.times = layer, times
        self.altered: list[Altered] = []
        self._claimed = 0  # parts chosen (their payload may still be on its way to the channel)
        self._lock = threading.Lock()
        self._plan = threading.local()  # on a sender's thread: [messages to skip, dtype, part] or None
        self._keep: list[torch.Tensor] = []  # the altered copies stay alive until the channel sent them

    def wrap_send_layers(self, send_layers):
        """The sender's send of a span of layers: picks the part, and the message that carries K of
        `layer` for its first token (one message per layer, or K and V of each run: wire.py)."""
        def patched(peer, t, layers, payloads):
            with self._lock:
                fire = self.layer in layers and self._claimed < self.times
                self._claimed += fire
            if fire:
                skip = layers.index(self.layer) * max(1, 2 * len(t.runs))
                self._plan.value = [skip, payloads[layers.index(self.layer)][0].dtype, (t.request_id, t.head_start)]
            try:
                return send_layers(peer, t, layers, payloads)
            finally:
                self._plan.value = None
        return patched

    def wrap_isend(self, isend):
        """The channel's send: the planned message goes out as a copy with element 0 altered."""
        def patched(channel, tensor, ready=None):
            plan = getattr(self._plan, "value", None)
            if plan is None:
                return isend(channel, tensor, ready)
            if plan[0] > 0:
                plan[0] -= 1
                return isend(channel, tensor, ready)
            self._plan.value = None
            if ready is not None:  # a CUDA payload: computed before it is copied
                ready.synchronize()
            wire = tensor.clone()  # (bytes,) of the message
            values = wire.view(plan[1])  # element 0: K of the part's first token, first head, dim 0
            before = float(values[0])
            values[0] = (values[0].float() + OFFSET).to(plan[1])
            with self._lock:
                self.altered.append(Altered(*plan[2], self.layer, 0, before, float(values[0])))
                self._keep.append(wire)
            return isend(channel, wire, ready)
        return patched


@contextlib.contextmanager
def corrupt_in_flight(layer: int = 1, times: int = 1):
    """While active, the next `times` KV parts sent over a data channel in this process carry one
    altered element of `layer` (module docstring). Yields the `InFlightCorruption`."""
    fault = InFlightCorruption(layer, times)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_Peer, "_send_layers", fault.wrap_send_layers(_Peer._send_layers)))
        for channel in (GlooChannel, NcclChannel):
            stack.enter_context(mock.patch.object(channel, "isend", fault.wrap_isend(channel.isend)))
        yield fault


def without_payload_macs(cluster) -> None:
    """Both ends of an in-process cluster's transfers without payload MACs, which would catch
    `corrupt_in_flight` (the negative controls: what happens with no protection at all). Call it
    before the first transfer: a connection takes the setting when it is made."""
    for inst in cluster.instances.values():
        end = inst.ranks[0].sender if inst.role == "prefill" else inst.ranks[0].receiver
        end.payload_mac = False
