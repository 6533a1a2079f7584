"""The KV control plane: small msgpack messages over a plain TCP connection, off the data path
(handshake, reservations, layer announcements, done and acks; the messages are in wire.py).

    server = ControlServer("10.0.0.5", open_session, SCHEMA)  # per connection: session(msg) -> reply or None
    client = ControlClient(server.address, SCHEMA)
    reply = client.call({"kind": "reserve", ...}, timeout_s=2.0)   # ControlTimeout past the deadline
    client.send(msg, 2.0); ...; reply = client.receive(2.0)         # replies come in the order sent

Every message is one msgpack map with a "kind" and exactly the fields `schema[kind]` names, of
those types. Anything else is garbage: the connection it came on is closed (a byte stream cannot
be resynchronized) and counted; the server goes on serving every other connection. A call past
its deadline closes its connection too (a late reply must not answer the next call); the next
call connects again.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter

import msgpack

from kvtransfer.wire import WireError, check_message

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 1 << 20  # a done with logprobs is under 1 KiB; a ready of a fragmented long prompt, 100s of KiB


class ControlError(RuntimeError):
    """The control connection failed: closed by the peer, refused, or garbage received."""


class ControlTimeout(ControlError):
    """No answer within the call's deadline."""


class ControlGarbage(ControlError):
    """What arrived is not a message of the schema (or not msgpack at all, or too big)."""


def check(msg, schema: dict[str, dict[str, type | tuple]]) -> dict:
    """`msg` if it is a message of `schema` (kvtransfer/wire.py: check_message); ControlGarbage
    naming what is wrong otherwise."""
    try:
        return check_message(msg, schema)
    except WireError as exc:
        raise ControlGarbage(str(exc)) from None


class _Connection:
    """One socket: whole messages out, whole messages in (each within a deadline)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE_BYTES)

    def send(self, msg: dict, deadline: float | None = None) -> None:
        try:
            self.sock.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))
            self.sock.sendall(msgpack.packb(msg))
        except TimeoutError:
            raise ControlTimeout("send timed out") from None
        except OSError as exc:
            raise ControlError(f"send failed: {exc}") from None

    def recv(self, deadline: float | None = None):
        """The next message (unchecked); ControlTimeout past `deadline`, ControlError when closed."""
        while True:
            try:
                return next(self.unpacker)
            except StopIteration:
                pass
            except Exception as exc:  # msgpack raises several types on garbage and oversize
                raise ControlGarbage(f"undecodable message: {type(exc).__name__}") from None
            try:
                self.sock.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))
                data = self.sock.recv(65536)
            except TimeoutError:
                raise ControlTimeout("no answer before the deadline") from None
            except OSError as exc:
                raise ControlError(f"receive failed: {exc}") from None
            if not data:
                raise ControlError("connection closed by the peer")
            try:
                self.unpacker.feed(data)
            except msgpack.BufferFull:
                raise ControlGarbage(f"message over {MAX_MESSAGE_BYTES} bytes") from None

    def closed_by_peer(self) -> bool:
        """Whether the peer closed (or reset) the connection; never blocks and reads nothing
        (a message waiting to be read is not a close)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable) and not self.sock.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):  # reset by the peer, or closed here
            return True

    def close(self) -> None:
        """Safe from any thread: a thread blocked receiving on this socket wakes with an error."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class ControlServer:
    """Accepts connections on `host` (any free port). Each connection gets a session,
    `open_session(drop)`: a callable that answers each message (None: no reply), whose optional
    `close()` runs when the connection ends; `drop()` closes that connection from any thread.
    One thread per connection. Counts connections, messages and garbage; a session that raises
    ControlGarbage counts as garbage too."""

    def __init__(self, host: str, open_session, schema: dict, backlog: int = 64):
        self.open_session, self.schema = open_session, schema
        self.stats: Counter = Counter()
        self._listener = socket.create_server((host, 0), backlog=backlog)
        self._closed = threading.Event()
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="kv-control-accept").start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in list(self._conns):
                conn.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock)
            with self._lock:
                self._conns.add(conn)
            self.stats["connections"] += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kv-control-conn").start()

    def _serve(self, conn: _Connection) -> None:
        session = None
        try:
            session = self.open_session(conn.close)
            while not self._closed.is_set():
                msg = check(conn.recv(), self.schema)
                self.stats["messages"] += 1
                reply = session(msg)
                if reply is not None:
                    conn.send(reply)
        except ControlGarbage as exc:
            self.stats["garbage"] += 1
            logger.warning("KV control: dropping a connection: %s", exc)
        except ControlError:  # the client went away (its deadline passed, or it closed)
            pass
        except Exception:  # a handler bug must not take the server down
            self.stats["handler_errors"] += 1
            logger.exception("KV control: handler failed; dropping its connection")
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
            if hasattr(session, "close"):
                session.close()


class ControlClient:
    """Calls on one server, one at a time; (re)connects on use, within the call's deadline."""

    def __init__(self, address: tuple[str, int], schema: dict):
        self.address, self.schema = tuple(address), schema
        self._conn: _Connection | None = None
        self._lock = threading.Lock()

    def call(self, msg: dict, timeout_s: float) -> dict:
        """Sends `msg`, returns the server's reply (checked against the schema)."""
        return self._exchange(check(msg, self.schema), timeout_s, reply=True)

    def send(self, msg: dict, timeout_s: float) -> None:
        """Sends `msg`, expecting no reply."""
        self._exchange(check(msg, self.schema), timeout_s, reply=False)

    def receive(self, timeout_s: float) -> dict:
        """The next reply (to a message sent earlier with `send`: replies come in order)."""
        return self._exchange(None, timeout_s, reply=True)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def shutdown(self) -> None:
        """Closes the connection from another thread without waiting for a call in progress
        (it fails at once); the next call connects again."""
        conn = self._conn
        if conn is not None:
            conn.close()

    def closed_by_peer(self) -> bool:
        """Whether the server closed the current connection (its process ended): never blocks.
        False with no connection, or while a call is in progress."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._conn is not None and self._conn.closed_by_peer()
        finally:
            self._lock.release()

    def _exchange(self, msg: dict | None, timeout_s: float, reply: bool):
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                if self._conn is None:
                    if msg is None:
                        raise ControlError("no connection to receive a reply on")
                    self._conn = _Connection(self._connect(deadline))
                if msg is not None:
                    self._conn.send(msg, deadline)
                return check(self._conn.recv(deadline), self.schema) if reply else None
            except ControlError:
                self._drop()  # a late or garbled reply must not answer the next call
                raise

    def _connect(self, deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=max(1e-3, deadline - time.monotonic()))
        except TimeoutError:
            raise ControlTimeout(f"connecting to {self.address} timed out") from None
        except OSError as exc:
            raise ControlError(f"cannot connect to {self.address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
