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

Authentication (wire.py: the cluster secret and the key K derived from it). Before any message
of the schema, both ends prove K (msgpack arrays; sn, cn: 32-byte random nonces):

    server -> client   [wire.HANDSHAKE, sn]                  on accept
    client -> server   [cn, HMAC(K, "client" | sn | cn)]      the server checks it (compare_digest)
    server -> client   [true, HMAC(K, "server" | sn | cn)]    the client checks it: a fake receiver
                       or [false, b""]: refused                gets no message either
    session key S = HMAC(K, "session" | sn | cn), fresh per connection

From then on each message travels as a frame, the msgpack array [seq, body, mac]: body is the
packed message, mac = HMAC-SHA256(S, direction | seq as 8 bytes big-endian | body), direction
b"c" from the client, b"s" from the server, seq counting each direction's frames from 0. A frame
whose MAC is wrong or whose seq is not the next (a replay, a reordering) ends the connection. A
peer that fails the handshake (a wrong proof, something else than an answer, no answer within
HANDSHAKE_TIMEOUT_S) or sends such a frame is refused: its connection is closed, counted in
stats["auth_refused"], and logged (one WARNING per host per REFUSAL_LOG_EVERY_S, naming its
address). Nothing it sent reaches a handler: a session is opened only after the handshake, and
a frame that fails is not handed to it. A peer that closes during the
handshake without sending anything (a port probe) is not counted. Bytes that are not msgpack at
all are garbage after the handshake, a refusal during it. `authenticate=False` (plain messages,
no handshake) exists only for bench/kv_transfer.py's comparison; nothing configures it.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter

import msgpack

from kvtransfer import wire
from kvtransfer.wire import WireError, check_message

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 1 << 20  # a done is under 1 KiB; a ready of a fragmented long prompt, 100s of KiB
FRAME_OVERHEAD = 64  # msgpack array header, seq and MAC around a message's body
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not proved the secret by then is refused
REFUSAL_LOG_EVERY_S = 60.0  # one WARNING per refused host in this long (the rest at DEBUG; all counted)
MAX_PENDING = 64  # connections in their handshake at once; more are closed unread
ACCEPT_RETRY_S = 0.05  # after a failed accept or thread start (out of descriptors, threads)


class ControlError(RuntimeError):
    """The control connection failed: closed by the peer, refused, or garbage received."""


class ControlTimeout(ControlError):
    """No answer within the call's deadline."""


class ControlGarbage(ControlError):
    """What arrived is not a message of the schema (or not msgpack at all, or too big)."""


class ControlAuthError(ControlError):
    """The peer did not prove the cluster secret, or a frame's MAC or sequence number is wrong."""


def check(msg, schema: dict[str, dict[str, type | tuple]]) -> dict:
    """`msg` if it is a message of `schema` (kvtransfer/wire.py: check_message); ControlGarbage
    naming what is wrong otherwise."""
    try:
        return check_message(msg, schema)
    except WireError as exc:
        raise ControlGarbage(str(exc)) from None


class _Connection:
    """One socket: whole messages out, whole messages in (each within a deadline); framed and
    MAC'd once `macs` is set (after the handshake), plain msgpack before (and without auth)."""

    def __init__(self, sock: socket.socket, peer: tuple = ("?", 0)):
        self.sock, self.peer = sock, tuple(peer[:2])
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE_BYTES + FRAME_OVERHEAD)
        self.macs: wire.MessageMacs | None = None

    def send(self, msg, deadline: float | None = None) -> None:
        data = msgpack.packb(msg)
        if self.macs is not None:
            data = msgpack.packb(self.macs.seal(data))
        try:
            self.sock.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))
            self.sock.sendall(data)
        except TimeoutError:
            raise ControlTimeout("send timed out") from None
        except OSError as exc:
            raise ControlError(f"send failed: {exc}") from None

    def recv(self, deadline: float | None = None):
        """The next message (unchecked), its frame verified when `macs` is set: ControlAuthError
        when that fails, ControlTimeout past `deadline`, ControlError when closed."""
        obj = self._next(deadline)
        if self.macs is None:
            return obj
        try:
            body = self.macs.open(obj)
        except wire.AuthError as exc:
            raise ControlAuthError(str(exc)) from None
        if len(body) > MAX_MESSAGE_BYTES:
            raise ControlGarbage(f"message over {MAX_MESSAGE_BYTES} bytes")
        try:
            return msgpack.unpackb(body, raw=False)
        except Exception as exc:  # msgpack raises several types on garbage
            raise ControlGarbage(f"undecodable message: {type(exc).__name__}") from None

    def _next(self, deadline: float | None):
        """The next msgpack object off the socket."""
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


def _key(authenticate: bool, what: str) -> bytes | None:
    if authenticate:
        if what == "server":
            wire.require_strong_secret()
        return wire.kv_control_key()
    logger.warning("KV control %s without authentication: for a benchmark's comparison only", what)
    return None


class ControlServer:
    """Accepts connections on `host` (any free port). Each connection, once it proved the cluster
    secret (module docstring), gets a session, `open_session(drop)`: a callable that answers each
    message (None: no reply), whose optional `close()` runs when the connection ends; `drop()`
    closes that connection from any thread. One thread per connection. Counts connections,
    messages, garbage and refused peers (auth_refused); a session that raises ControlGarbage
    counts as garbage too. `authenticate=False`: bench/kv_transfer.py's comparison only.
    `session_keys`: `open_session(drop, session_key)` instead, the connection's session key
    (None without authentication), from which its payload MACs' key derives (wire.payload_key)."""

    def __init__(self, host: str, open_session, schema: dict, backlog: int = 64, *, authenticate: bool = True,
                 max_pending: int = MAX_PENDING, session_keys: bool = False):
        self.open_session, self.schema, self.session_keys = open_session, schema, session_keys
        self._key = _key(authenticate, "server")
        self._pending = threading.BoundedSemaphore(max_pending)  # connections not yet past the handshake
        self.stats: Counter = Counter()
        self._refusals_logged: dict[str, float] = {}  # host -> when its last refusal was logged at WARNING
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
        """Until closed, whatever one connection does (module docstring: bounds)."""
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if not self._closed.is_set():
                    self._accept_failed("accept_errors", exc)
                continue
            if not self._pending.acquire(blocking=False):  # released once its handshake ended
                self.stats["pending_refused"] += 1
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, peer)
            with self._lock:
                self._conns.add(conn)
            self.stats["connections"] += 1
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kv-control-conn").start()
            except RuntimeError as exc:  # "can't start new thread"
                self._end(conn, pending=True)
                self._accept_failed("thread_errors", exc)

    def _accept_failed(self, what: str, exc: Exception) -> None:
        self.stats[what] += 1
        logger.warning("KV control: %s (counted in %s); the server goes on", exc, what)
        time.sleep(ACCEPT_RETRY_S)

    def _end(self, conn: _Connection, pending: bool) -> None:
        conn.close()
        with self._lock:
            self._conns.discard(conn)
        if pending:
            self._pending.release()

    def _serve(self, conn: _Connection) -> None:
        session, pending = None, True
        try:
            if self._key is not None:  # no session (nothing reaches a handler) before the peer proved the secret
                self._challenge(conn)
            pending = False
            self._pending.release()
            session = self._open(conn)
            while not self._closed.is_set():
                msg = check(conn.recv(), self.schema)
                self.stats["messages"] += 1
                reply = session(msg)
                if reply is not None:
                    conn.send(reply)
        except ControlAuthError as exc:
            self._refused(conn, exc)
        except ControlGarbage as exc:
            self.stats["garbage"] += 1
            logger.warning("KV control: dropping a connection: %s", exc)
        except ControlError:  # the client went away (its deadline passed, or it closed)
            pass
        except Exception:  # a handler bug must not take the server down
            self.stats["handler_errors"] += 1
            logger.exception("KV control: handler failed; dropping its connection")
        finally:
            self._end(conn, pending)
            if hasattr(session, "close"):
                session.close()

    def _open(self, conn: _Connection):
        if not self.session_keys:
            return self.open_session(conn.close)
        return self.open_session(conn.close, None if conn.macs is None else conn.macs.key)

    def _challenge(self, conn: _Connection) -> None:
        """The server's side of the handshake: ControlAuthError when the peer fails it (or sends
        nothing within HANDSHAKE_TIMEOUT_S); ControlError, not a refusal, when it closed."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            conn.macs = wire.challenge(conn, self._key, deadline)
        except wire.AuthError as exc:
            if exc.reply is not None:  # so a sender holding another secret can say why it was refused
                try:
                    conn.send(exc.reply, deadline)
                except ControlError:
                    pass
            raise ControlAuthError(str(exc)) from None
        except (ControlTimeout, ControlGarbage) as exc:
            raise ControlAuthError(f"no answer to the challenge: {exc}") from None

    def _refused(self, conn: _Connection, exc: ControlAuthError) -> None:
        """Counts a refused peer; logs it at WARNING unless its host was, REFUSAL_LOG_EVERY_S ago or less."""
        now, host = time.monotonic(), conn.peer[0]
        with self._lock:
            self.stats["auth_refused"] += 1
            last = self._refusals_logged.get(host)
            loud = last is None or now - last > REFUSAL_LOG_EVERY_S
            if loud:
                if len(self._refusals_logged) > 1024:  # many hosts: forget them rather than grow
                    self._refusals_logged.clear()
                self._refusals_logged[host] = now
        (logger.warning if loud else logger.debug)(
            "KV control: refused the peer at %s:%s and closed its connection: %s (counted in auth_refused; "
            "further refusals of that host within %.0f s at DEBUG)", host, conn.peer[1], exc, REFUSAL_LOG_EVERY_S)


class ControlClient:
    """Calls on one server, one at a time; (re)connects on use, within the call's deadline, and
    proves the cluster secret (the server proves it too) before the first message.
    `authenticate=False`: bench/kv_transfer.py's comparison only."""

    def __init__(self, address: tuple[str, int], schema: dict, *, authenticate: bool = True):
        self.address, self.schema = tuple(address), schema
        self._key = _key(authenticate, "client")
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

    @property
    def session_key(self) -> bytes | None:
        """The current connection's session key (None: not connected, or unauthenticated)."""
        conn = self._conn
        return None if conn is None or conn.macs is None else conn.macs.key

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
                    self._conn = _Connection(self._connect(deadline), self.address)
                    if self._key is not None:
                        self._prove(deadline)
                if msg is not None:
                    self._conn.send(msg, deadline)
                return check(self._conn.recv(deadline), self.schema) if reply else None
            except ControlError:
                self._drop()  # a late or garbled reply must not answer the next call
                raise

    def _prove(self, deadline: float) -> None:
        """The client's side of the handshake, before anything of the schema is sent."""
        try:
            self._conn.macs = wire.prove(self._conn, self._key, deadline)
        except (wire.AuthError, ControlGarbage) as exc:
            raise ControlAuthError(f"KV control handshake with {self.address[0]}:{self.address[1]}: {exc}") from None

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
