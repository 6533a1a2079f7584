"""The KV control channel (kvtransfer/control.py): calls answered in order under concurrency,
every deadline firing with the connection rebuilt, garbage of every kind dropped and counted
while the server goes on serving. Authentication itself: test_auth.py."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvtransfer.control import MAX_MESSAGE_BYTES, ControlClient, ControlError, ControlServer, ControlTimeout, check

SCHEMA = {"reserve": {"request_id": str, "num_tokens": int, "delay_s": float},
          "reserved": {"request_id": str, "ok": bool, "error": (str, type(None))},
          "note": {"text": str}}
DEADLINE_S = 0.3


def reserve(rid: str, n: int = 16, delay_s: float = 0.0) -> dict:
    return {"kind": "reserve", "request_id": rid, "num_tokens": n, "delay_s": delay_s}


@pytest.fixture
def server():
    notes = []

    def handler(msg: dict):
        if msg["kind"] == "note":
            notes.append(msg["text"])
            return None
        time.sleep(msg["delay_s"])
        return {"kind": "reserved", "request_id": msg["request_id"], "ok": msg["num_tokens"] <= 64,
                "error": None if msg["num_tokens"] <= 64 else "no room"}
    s = ControlServer("127.0.0.1", lambda drop: handler, SCHEMA)
    s.notes = notes
    yield s
    s.close()


def test_calls_answer_in_order_from_many_threads(server):
    """8 clients x 40 calls at once: every reply is the one to its own call."""
    errors = []

    def run(t: int) -> None:
        client = ControlClient(server.address, SCHEMA)
        for i in range(40):
            reply = client.call(reserve(f"{t}-{i}", n=i * 2), timeout_s=10)
            if reply != {"kind": "reserved", "request_id": f"{t}-{i}", "ok": i * 2 <= 64,
                         "error": None if i * 2 <= 64 else "no room"}:
                errors.append(reply)
        client.close()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert errors == [] and server.stats["messages"] == 320 and server.stats["garbage"] == 0


def test_a_late_answer_times_out_and_never_answers_the_next_call(server):
    client = ControlClient(server.address, SCHEMA)
    start = time.monotonic()
    with pytest.raises(ControlTimeout):
        client.call(reserve("slow", delay_s=3 * DEADLINE_S), timeout_s=DEADLINE_S)
    assert DEADLINE_S <= time.monotonic() - start < 10 * DEADLINE_S
    assert client.call(reserve("next"), timeout_s=10)["request_id"] == "next"
    assert server.stats["connections"] == 2  # the timed-out connection was dropped, a new one made
    time.sleep(3 * DEADLINE_S)  # the late answer meets a closed connection: not garbage
    assert server.stats["garbage"] == 0


def test_one_way_messages_arrive(server):
    client = ControlClient(server.address, SCHEMA)
    client.send({"kind": "note", "text": "hello"}, timeout_s=5)
    assert client.call(reserve("after"), timeout_s=5)["ok"]
    assert server.notes == ["hello"]


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed while what it was sent was still unread
        return True


@pytest.mark.parametrize("raw", [
    b"\xc1",  # never valid msgpack
    {"kind": "reserve", "request_id": "x"},  # fields missing
    {"kind": "reserve", "request_id": "x", "num_tokens": True, "delay_s": 0.0},  # bool is no int
    {"kind": "launch", "x": 1},  # unknown kind
    [1, 2, 3],  # not a map
    {"kind": "note", "text": "x" * (MAX_MESSAGE_BYTES + 1)},  # too big
])
def test_garbage_closes_its_connection_is_counted_and_serving_goes_on(server, raw):
    """An authenticated peer's bytes that are not msgpack, or a frame whose MAC is right around
    something that is no message of the schema: garbage (not a refusal), the connection closed."""
    client = ControlClient(server.address, SCHEMA)
    client.send({"kind": "note", "text": "authenticated"}, timeout_s=5)
    conn = client._conn
    try:
        if isinstance(raw, bytes):
            conn.sock.sendall(raw)
        else:  # framed and MAC'd, never checked against the schema
            conn.send(raw, time.monotonic() + 5)
    except ControlError:  # the server closed before the whole of a too big message went
        pass
    assert closed_by_server(conn.sock)
    deadline = time.monotonic() + 5
    while server.stats["garbage"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats["garbage"] == 1 and server.stats["auth_refused"] == 0
    assert ControlClient(server.address, SCHEMA).call(reserve("ok"), timeout_s=5)["ok"]


def test_a_server_that_stops_answering_or_is_gone():
    """A handler that never returns: the call times out. A closed server: refused at once."""
    stuck = threading.Event()
    server = ControlServer("127.0.0.1", lambda drop: lambda msg: stuck.wait(), SCHEMA)
    client = ControlClient(server.address, SCHEMA)
    with pytest.raises(ControlTimeout):
        client.call(reserve("x"), timeout_s=DEADLINE_S)
    stuck.set()
    server.close()
    start = time.monotonic()
    with pytest.raises(ControlError):
        client.call(reserve("y"), timeout_s=5)
    assert time.monotonic() - start < 5


def test_a_garbled_reply_is_an_error_and_the_next_call_reconnects():
    replies = iter([{"kind": "nonsense"}, {"kind": "reserved", "request_id": "b", "ok": True, "error": None}])
    server = ControlServer("127.0.0.1", lambda drop: lambda msg: next(replies), SCHEMA)
    try:
        client = ControlClient(server.address, SCHEMA)
        with pytest.raises(ControlError, match="unknown message"):
            client.call(reserve("a"), timeout_s=5)
        assert client.call(reserve("b"), timeout_s=5)["request_id"] == "b"
    finally:
        server.close()


def test_check_refuses_what_the_schema_does_not_name():
    assert check(reserve("a"), SCHEMA)["request_id"] == "a"
    with pytest.raises(ControlError, match="reserve.num_tokens has type str"):
        check({**reserve("a"), "num_tokens": "16"}, SCHEMA)
    with pytest.raises(ControlError):
        ControlClient(("127.0.0.1", 1), SCHEMA).send({"kind": "note"}, timeout_s=1)


def test_close_ends_the_accepting_thread():
    """A closed server leaves no thread behind (a blocked accept() wakes only on shutdown)."""
    import threading
    before = set(threading.enumerate())
    server = ControlServer("127.0.0.1", lambda drop: (lambda msg: None), SCHEMA)
    accepting = [t for t in set(threading.enumerate()) - before if t.name == "kv-control-accept"]
    server.close()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in accepting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert accepting and not any(t.is_alive() for t in accepting)


def _challenged(sock: socket.socket) -> bool:
    """Whether the server sent this raw connection its challenge (False: closed unread)."""
    sock.settimeout(5)
    try:
        return bool(sock.recv(256))
    except OSError:
        return False


def test_connections_beyond_the_pending_bound_are_refused_and_the_server_serves(server):
    """MAX_PENDING raw connections sit in their handshake: one more is closed at once, without a
    challenge, and counted; once they leave, an authenticated client is served."""
    from kvtransfer import control
    stragglers = [socket.create_connection(server.address, timeout=5) for _ in range(getattr(control, "MAX_PENDING", 64))]
    assert all(map(_challenged, stragglers))
    extra = socket.create_connection(server.address, timeout=5)
    assert not _challenged(extra) and server.stats["pending_refused"] == 1
    for s in [*stragglers, extra]:
        s.close()
    deadline = time.monotonic() + 30  # each handshake thread frees its slot as it sees its peer gone
    while True:
        client = None
        try:
            client = ControlClient(server.address, SCHEMA)
            assert client.call(reserve("r"), timeout_s=5.0)["ok"]
            break
        except ControlError:  # refused: the slots are not all free yet
            assert time.monotonic() < deadline, "the server never served again"
            time.sleep(0.05)
        finally:
            if client is not None:
                client.close()


def test_a_thread_that_cannot_start_leaves_the_accept_loop_alive(server, monkeypatch):
    """The connection whose thread fails to start is closed and counted; the next one is served."""
    from kvtransfer import control
    real, failed = threading.Thread, []

    class Failing(real):
        def start(self):
            if self.name == "kv-control-conn" and not failed:
                failed.append(self)
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(control.threading, "Thread", Failing)
    first = socket.create_connection(server.address, timeout=5)
    assert not _challenged(first) and failed
    monkeypatch.setattr(control.threading, "Thread", real)
    client = ControlClient(server.address, SCHEMA)
    assert client.call(reserve("r"), timeout_s=5.0)["ok"] and server.stats["thread_errors"] == 1
    client.close(), first.close()
