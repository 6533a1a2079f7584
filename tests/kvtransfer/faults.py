"""A fault-injecting proxy in front of a KV receiver's control port (the data channel goes
direct: its rendezvous address comes in the receiver's welcome).

It parses the sender's msgpack stream, so a fault can start at a given message kind:

    proxy = FaultProxy(rx.endpoint_address)
    proxy.blackhole_from = "begin"   # from the first begin on, nothing passes either way (a peer
                                     # that stops answering, its TCP connection still open)
    proxy.delay_s = 0.05             # every message waits this long, both ways
    proxy.garbage_at = "layer"       # that message is replaced by bytes that are not msgpack
"""
from __future__ import annotations

import socket
import threading
import time

import msgpack

from kvtransfer.params import KVEndpoint


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
                    kind = msg.get("kind") if isinstance(msg, dict) else "?"
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
