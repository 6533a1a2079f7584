"""Where a data channel's two ranks meet (channel.py): a TCPStore per control connection, made
by the receiver after the handshake, bound to the rank's own host, its keys under a random prefix
that only the two ends know, and gone once both ends of the channel are built.

    receiver, on hello (the peer proved the cluster secret)    sender
    r = Rendezvous(host)  -> welcome {store_port, store_prefix} --> join(host, port, prefix)
    channel built on r.store()                                      channel built on its store
    r.close() at the sender's first `begin`  <------------------  begin (sent once its end is built)
    (gloo; NCCL: when the channel closes, it bootstraps lazily)

Why not as soon as the receiver's end is built: the sender's end may still be reading the store
then (gloo's rendezvous is not over for both ranks at once); on a loaded host, closing it there
failed the sender's build ("Failed to recv, got 0 bytes") and dropped the pair.

What this denies a stranger who can reach the host: the store listens only on the address the
rank was given (a socket bound here and handed to torch: `master_listen_fd`, honoured by the
libuv backend, torch's default); it exists for one rendezvous (milliseconds) and serves one
pair; its key names are 24 random bytes that cross only the MAC'd control channel, so keys set
in advance under guessable names ("pg/<channel>/", before protocol 15) meet nobody. A stranger
who connects during that window could still list keys and race the sender: the payload MAC
(wire.py PartMac) makes anything it then sends fail its part.
"""
from __future__ import annotations

import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

PREFIX_BYTES = 24


def _listen(host: str) -> socket.socket:
    """A listening socket on `host` (IPv4 or IPv6), any free port."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(8)
    except OSError:
        sock.close()
        raise
    return sock


class Rendezvous:
    """The receiver's side: a TCPStore server on `host` alone, for one data channel."""

    def __init__(self, host: str, timeout_s: float):
        self.host, self.timeout_s = host, timeout_s
        self.prefix = secrets.token_urlsafe(PREFIX_BYTES) + "/"
        sock = _listen(host)
        self.port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the socket from here and closes it when it stops
        try:
            self._server = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
        except BaseException:
            socket.socket(fileno=fd).close()
            raise

    def store(self) -> dist.Store:
        """A client of the server under the prefix: what the receiver's rank builds on. A client,
        not the server object, so that close() stops the server while the group keeps its store."""
        return join(self.host, self.port, self.prefix, self.timeout_s)

    def close(self) -> None:
        """Stops the server (its listening socket closes) once nothing else holds it; repeatable."""
        self._server = None


def join(host: str, port: int, prefix: str, timeout_s: float) -> dist.Store:
    """The store of a rendezvous at host:port (the welcome's), under `prefix`."""
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)
