"""Authentication of the KV control channel (kvtransfer/wire.py, control.py): where the cluster
secret comes from; a sender holding it transfers, any other peer (another secret, no handshake,
a fake receiver, a tampered, replayed, reordered or reflected frame, silence) is refused,
counted, logged by address and never the secret, and writes nothing into the cache."""
from __future__ import annotations

import hmac
import logging
import socket
import threading
import time

import msgpack
import pytest
import torch

from kvtransfer import control, wire
from kvtransfer.wire import SECRET_ENV, MessageMacs
from kvtransfer.base import TransferError
from kvtransfer.registry import create_kv_transport
from kvtransfer.control import ControlAuthError, ControlClient, ControlError, ControlServer
from tests.kvtransfer.test_torch_dist import (COMPAT, HEADS, TRAILER, _raw_connection, _wait_for, make_cache,
                                              make_receiver, poll_until, send_part)

pytestmark = pytest.mark.timeout(60)
SCHEMA = {"note": {"text": str}}
OTHER_SECRET = "not-the-cluster-secret-0123456789abcdef"


def note(text: str) -> dict:
    return {"kind": "note", "text": text}


@pytest.fixture
def server():
    """A bare control server whose handler records the notes it is handed."""
    notes = []
    s = ControlServer("127.0.0.1", lambda drop: (lambda msg: notes.append(msg["text"])), SCHEMA)
    s.notes = notes
    yield s
    s.close()


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Reads (and drops) what the server sends until it closes the connection."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_the_secret_comes_from_the_cluster_env_then_the_ray_token_then_its_file(monkeypatch, tmp_path):
    """PDSERVE_CLUSTER_SECRET wins over RAY_AUTH_TOKEN, which wins over RAY_AUTH_TOKEN_PATH's file
    (read without its trailing newline)."""
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-token")
    assert wire.cluster_secret() == b"kvtransfer-tests-secret-0123456789abcdef"
    monkeypatch.delenv(SECRET_ENV)
    assert wire.cluster_secret() == b"ray-token"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "")  # Ray with auth disabled
    assert wire.cluster_secret() == b"from-the-file"
    token_file.unlink()
    with pytest.raises(OSError):  # a node whose token file is gone is misconfigured: no made-up secret
        wire.cluster_secret()


def test_without_any_secret_one_is_generated_for_the_process_and_logged_once(monkeypatch, caplog):
    for name in (SECRET_ENV, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="kvtransfer.wire"):
        first, second = wire.cluster_secret(), wire.cluster_secret()
    assert first == second and len(first) == 64 and wire.os.environ[SECRET_ENV] == first.decode()
    assert [r.levelname for r in caplog.records] == ["INFO"] and "per-process" in caplog.text
    assert first.decode() not in caplog.text


def test_the_kv_key_is_derived_from_the_secret_never_the_secret_itself():
    key = wire.kv_control_key(b"ray-token")
    assert key == hmac.digest(b"ray-token", b"pdserve-kv-control-v1", "sha256") and b"ray-token" not in key
    assert wire.kv_control_key(b"another") != key and wire.kv_control_key() == wire.kv_control_key()


def test_a_sender_holding_the_cluster_secret_transfers():
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("r", torch.arange(4), 1)
    send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)] and rx.stats["auth_refused"] == 0
    assert dst.abs().sum() > 0
    tx.close(), rx.close()


def test_a_sender_with_another_secret_is_refused_counted_and_writes_nothing(monkeypatch, caplog):
    """The sender's part fails naming the cause; the receiver counts one refusal, logs its address
    (no secret), handles no hello, leaves the cache and the reservation as they were: a sender
    with the right secret then fills that very reservation."""
    rx, dst, dest = make_receiver()
    rx.expect("r", torch.arange(4), 1)
    monkeypatch.setenv(SECRET_ENV, OTHER_SECRET)
    stranger = create_kv_transport("torch").sender(COMPAT, "stranger")
    with caplog.at_level(logging.WARNING), pytest.raises(TransferError, match="another cluster secret"):
        send_part(stranger, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert _wait_for(lambda: rx.stats["auth_refused"] == 1)
    assert dst.abs().sum() == 0 and rx.stats.get("connections", 0) == 0 and rx.poll() == ([], [])
    refusals = [r.getMessage() for r in caplog.records if r.name == "kvtransfer.control"]
    assert len(refusals) == 1 and "127.0.0.1" in refusals[0]
    assert OTHER_SECRET not in caplog.text and "kvtransfer-tests-secret-0123456789abcdef" not in caplog.text
    monkeypatch.setenv(SECRET_ENV, "kvtransfer-tests-secret-0123456789abcdef")
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    stranger.close(), tx.close(), rx.close()


def test_a_hello_without_the_handshake_is_refused_and_logged_once_per_host(caplog):
    """A raw socket sending a well-formed msgpack hello (twice): both refused and closed, counted;
    one WARNING for the host; no hello reaches the receiver."""
    rx, dst, dest = make_receiver()
    hello = {"kind": "hello", "sender_id": "evil", "compat": COMPAT.to_dict(), "device_key": ""}
    with caplog.at_level(logging.WARNING, logger="kvtransfer.control"):
        for _ in range(2):
            with socket.create_connection(dest.address, timeout=5) as sock:
                sock.sendall(msgpack.packb(hello))
                assert closed_by_server(sock)
        assert _wait_for(lambda: rx.stats["auth_refused"] == 2)
    assert len(caplog.records) == 1 and "127.0.0.1" in caplog.text and "unauthenticated peer" in caplog.text
    assert rx.stats.get("connections", 0) == 0 and rx.stats["garbage_messages"] == 0 and dst.abs().sum() == 0
    rx.close()


def _fake_receiver(received: list) -> tuple[socket.socket, threading.Thread]:
    """A listener that challenges, accepts any proof, answers with a made-up one, and keeps what
    it receives afterwards until the client closes (then its thread ends)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = listener.accept()
        sock.sendall(msgpack.packb([wire.HANDSHAKE, wire.new_nonce()]))
        unpacker = msgpack.Unpacker(raw=False)
        while data := sock.recv(65536):
            unpacker.feed(data)
            for obj in unpacker:
                received.append(obj)
                if len(received) == 1:
                    sock.sendall(msgpack.packb([True, bytes(32)]))
        sock.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_fake_receiver_gets_nothing_but_the_proof():
    """A receiver that cannot prove the secret: the client fails and sends it no message."""
    received = []
    listener, fake = _fake_receiver(received)
    client = ControlClient(listener.getsockname(), SCHEMA)
    with pytest.raises(ControlAuthError, match="did not prove the cluster secret"):
        client.send(note("for the receiver only"), timeout_s=5)
    client.close()
    fake.join(5)
    assert not fake.is_alive() and len(received) == 1 and len(received[0]) == 2  # [client nonce, proof]
    listener.close()


@pytest.mark.parametrize("tamper", ["body", "mac", "plain map"])
def test_a_tampered_begin_mid_session_is_refused_and_reserves_nothing(tamper):
    """After a good handshake and hello, a begin whose body was changed after its MAC, whose MAC
    is wrong, or that comes without a frame: the connection is closed and counted, the request
    is not begun (nothing fails, nothing is written) and a real sender then fills it."""
    rx, dst, dest = make_receiver()
    rx.expect("r", torch.arange(4), 1)
    client = _raw_connection(dest)
    conn = client._conn
    begin = {"kind": "begin", "request_id": "r", "head_start": 0, "head_end": HEADS, "num_tokens": 4, "trace": ""}
    seq, body, mac = conn.macs.seal(msgpack.packb(begin))
    frame = {"body": [seq, msgpack.packb({**begin, "num_tokens": 3}), mac],
             "mac": [seq, body, bytes([mac[0] ^ 1]) + mac[1:]], "plain map": begin}[tamper]
    conn.sock.sendall(msgpack.packb(frame))
    assert closed_by_server(conn.sock) and _wait_for(lambda: rx.stats["auth_refused"] == 1)
    assert rx.stats["garbage_messages"] == 0 and rx.poll() == ([], []) and dst.abs().sum() == 0
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)]
    client.close(), tx.close(), rx.close()


@pytest.mark.parametrize("how", ["replayed", "reordered", "reflected"])
def test_a_replayed_reordered_or_reflected_frame_is_refused(server, how):
    """Frames whose MACs are genuine but that come out of sequence (the first one again; the
    third before the second) or in the server's own direction: refused, closed, never handled."""
    client = ControlClient(server.address, SCHEMA)
    client.send(note("first"), timeout_s=5)
    conn = client._conn
    if how == "replayed":
        frames = [MessageMacs(conn.macs.key, is_server=False).seal(msgpack.packb(note("first")))]
    elif how == "reordered":
        second, third = (conn.macs.seal(msgpack.packb(note(t))) for t in ("second", "third"))
        frames = [third, second]
    else:
        reflected = MessageMacs(conn.macs.key, is_server=True)
        reflected.send_seq = conn.macs.send_seq
        frames = [reflected.seal(msgpack.packb(note("reflected")))]
    conn.sock.sendall(b"".join(msgpack.packb(f) for f in frames))
    assert closed_by_server(conn.sock) and _wait_for(lambda: server.stats["auth_refused"] == 1)
    assert server.notes == ["first"]
    ControlClient(server.address, SCHEMA).send(note("next"), timeout_s=5)
    assert _wait_for(lambda: server.notes == ["first", "next"])


def test_a_silent_peer_is_refused_at_the_handshake_deadline(server, monkeypatch):
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT_S", 0.3)
    start = time.monotonic()
    with socket.create_connection(server.address, timeout=5) as sock:
        assert closed_by_server(sock)
    assert 0.3 <= time.monotonic() - start < 5 and _wait_for(lambda: server.stats["auth_refused"] == 1)


def test_a_port_probe_is_no_refusal(server, caplog):
    """Connecting and closing without a word (a reachability check) is neither counted nor logged."""
    with caplog.at_level(logging.WARNING, logger="kvtransfer.control"):
        socket.create_connection(server.address, timeout=5).close()
        assert _wait_for(lambda: server.stats["connections"] == 1 and not server._conns)
    assert server.stats["auth_refused"] == 0 and caplog.records == []


def test_unauthenticated_ends_exist_for_the_benchmark_and_an_authenticated_server_refuses_them(server):
    plain = ControlServer("127.0.0.1", lambda drop: (lambda msg: None), SCHEMA, authenticate=False)
    ControlClient(plain.address, SCHEMA, authenticate=False).send(note("x"), timeout_s=5)
    assert _wait_for(lambda: plain.stats["messages"] == 1)
    with pytest.raises(ControlError):  # the challenge is no message of its schema
        ControlClient(server.address, SCHEMA, authenticate=False).call(note("x"), timeout_s=5)
    assert _wait_for(lambda: server.stats["auth_refused"] == 1) and server.notes == []
    plain.close()


def test_a_weak_cluster_secret_is_refused_in_one_line(monkeypatch):
    """A KV server will not start with a PDSERVE_CLUSTER_SECRET under 32 characters: one line,
    naming the variable and the bound, never the secret."""
    monkeypatch.setenv(SECRET_ENV, "short-secret")
    with pytest.raises(ValueError) as refused:
        ControlServer("127.0.0.1", lambda drop: (lambda msg: None), SCHEMA)
    text = str(refused.value)
    assert "\n" not in text and SECRET_ENV in text and "32" in text and "short-secret" not in text
