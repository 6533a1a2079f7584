"""Authentication of the KV control channel (control.py): the cluster secret, the key derived
from it, both sides of the handshake (over any connection that sends and receives msgpack
objects) and the per-message MACs. The protocol, and how a refused peer is handled, are in
control.py's docstring; the threat model in docs/security.md.

Where the secret comes from (cluster_secret): PDSERVE_CLUSTER_SECRET, the KV secret, at least
MIN_SECRET_CHARS characters (a KV server refuses a shorter one at start: require_strong_secret).
Without it, Ray's token (RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names), which every
process of a pdserve cluster holds (cluster/control/instance.py setup_ray_auth for a local
cluster; the Helm chart gives every Ray pod RAY_AUTH_TOKEN from a Secret): that fallback works
but is logged as a WARNING once per process, since whoever holds the Ray token (a Ray client,
the dashboard's operators) then also holds the KV key; set PDSERVE_CLUSTER_SECRET apart from it.
With neither, a random secret is made for this process and put in its environment, so its own
senders and receivers (and the processes it starts afterwards) agree; peers in other processes
cannot connect to it.

The secret is never a MAC key itself: the KV key is HMAC-SHA256(secret, KV_CONTROL_LABEL), so a
key that leaked from here does not give away Ray's token, and another use of the secret would
derive a key of its own under another label. KV payloads (not the control messages) are MAC'd
with payload_key(session key) (checksum.py PartMac), so one connection's payload key says
nothing of another's.
"""
from __future__ import annotations

import functools
import hmac
import logging
import os
import secrets
import struct

logger = logging.getLogger(__name__)
SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
HANDSHAKE = "pdserve-kv-auth-v1"  # the challenge's first element: names the protocol and its version
KV_CONTROL_LABEL = b"pdserve-kv-control-v1"
KV_PAYLOAD_LABEL = b"pdserve-kv-payload-v1"
MIN_SECRET_CHARS = 32  # 32 hex characters: 128 bits; `openssl rand -hex 32` gives 64
NONCE_BYTES = 32
_SEQ = struct.Struct(">Q")


class AuthError(Exception):
    """A handshake proof or a message's MAC does not verify, or a message is out of sequence.
    `reply`: what to send the peer before closing (a refusal it can report), or None."""

    def __init__(self, message: str, reply: list | None = None):
        super().__init__(message)
        self.reply = reply


def cluster_secret() -> bytes:
    """The cluster's shared secret (module docstring: where it comes from). Read from the
    environment on every call, so a process that sets it before building its transport uses it.
    Raises OSError when RAY_AUTH_TOKEN_PATH names a file that cannot be read: that is a
    misconfigured node, and a made-up secret would only refuse every peer later."""
    secret = os.environ.get(SECRET_ENV)
    if not secret and (secret := os.environ.get("RAY_AUTH_TOKEN")):
        _warn_ray_token_fallback()
    if not secret and (path := os.environ.get("RAY_AUTH_TOKEN_PATH")):
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
        if not secret:
            raise OSError(f"RAY_AUTH_TOKEN_PATH names an empty file: {path}")
        _warn_ray_token_fallback()
    if not secret:
        secret = secrets.token_hex(32)
        os.environ[SECRET_ENV] = secret  # the next call finds it: logged once per process
        logger.info("no %s or Ray token here: generated a per-process cluster secret; KV peers in other "
                    "processes (that did not inherit it) cannot connect to this one", SECRET_ENV)
    return secret.encode()


@functools.cache  # once per process: every connection reads the secret
def _warn_ray_token_fallback() -> None:
    logger.warning("no %s: the KV channel's key is derived from the Ray token, so whoever holds that token can "
                   "also speak to KV endpoints; set %s (at least %d characters) apart from it", SECRET_ENV,
                   SECRET_ENV, MIN_SECRET_CHARS)


def require_strong_secret() -> None:
    """ValueError (one line, no secret in it) when PDSERVE_CLUSTER_SECRET is set and shorter than
    MIN_SECRET_CHARS. A KV server calls it before listening (control.py), so a weak secret stops
    the decode rank at start; a sender holding a weak secret is refused at the handshake anyway."""
    secret = os.environ.get(SECRET_ENV)
    if secret and len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{SECRET_ENV} has {len(secret)} characters, at least {MIN_SECRET_CHARS} are required "
                         f"(e.g. the output of `openssl rand -hex 32`)")


def payload_key(session_key: bytes) -> bytes:
    """The key of one control connection's KV payload MACs: HMAC-SHA256(session key, KV_PAYLOAD_LABEL)."""
    return hmac.digest(session_key, KV_PAYLOAD_LABEL, "sha256")


def kv_control_key(secret: bytes | None = None) -> bytes:
    """The KV control channel's key: HMAC-SHA256(secret, KV_CONTROL_LABEL), of cluster_secret()
    unless `secret` is given."""
    return hmac.digest(cluster_secret() if secret is None else secret, KV_CONTROL_LABEL, "sha256")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def derive(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256(key, label | server_nonce | client_nonce): a proof (label b"client" or
    b"server") or the connection's session key (b"session"). Both nonces are NONCE_BYTES long,
    so the concatenation is unambiguous."""
    assert len(server_nonce) == NONCE_BYTES and len(client_nonce) == NONCE_BYTES
    return hmac.digest(key, label + server_nonce + client_nonce, "sha256")


def challenge(conn, key: bytes, deadline: float) -> MessageMacs:
    """The server's side of the handshake (control.py's docstring) on `conn` (send(obj, deadline),
    recv(deadline) of msgpack objects; what they raise goes through). Returns the connection's
    MACs; AuthError when the peer's answer is no answer or its proof is wrong."""
    server_nonce = new_nonce()
    conn.send([HANDSHAKE, server_nonce], deadline)
    answer = conn.recv(deadline)
    if not (isinstance(answer, list) and len(answer) == 2 and all(isinstance(x, bytes) for x in answer)
            and len(answer[0]) == NONCE_BYTES):
        raise AuthError(f"no answer to the challenge but a {type(answer).__name__} (an unauthenticated peer?)")
    client_nonce, proof = answer
    if not hmac.compare_digest(proof, derive(key, b"client", server_nonce, client_nonce)):
        raise AuthError("wrong proof of the cluster secret", reply=[False, b""])
    conn.send([True, derive(key, b"server", server_nonce, client_nonce)], deadline)
    return MessageMacs(derive(key, b"session", server_nonce, client_nonce), is_server=True)


def prove(conn, key: bytes, deadline: float) -> MessageMacs:
    """The client's side of the handshake on `conn` (as in `challenge`). Returns the connection's
    MACs; AuthError when the server sent no challenge, refused this end's proof, or did not
    prove the secret itself (a fake receiver: nothing has been sent to it but the proof)."""
    msg = conn.recv(deadline)
    if not (isinstance(msg, list) and len(msg) == 2 and msg[0] == HANDSHAKE and isinstance(msg[1], bytes)
            and len(msg[1]) == NONCE_BYTES):
        raise AuthError(f"no authentication challenge but a {type(msg).__name__} (an unauthenticated receiver?)")
    server_nonce, client_nonce = msg[1], new_nonce()
    conn.send([client_nonce, derive(key, b"client", server_nonce, client_nonce)], deadline)
    verdict = conn.recv(deadline)
    if verdict == [False, b""]:
        raise AuthError(f"refused: the receiver holds another cluster secret ({SECRET_ENV} or the Ray token differ)")
    if not (isinstance(verdict, list) and len(verdict) == 2 and verdict[0] is True and isinstance(verdict[1], bytes)
            and hmac.compare_digest(verdict[1], derive(key, b"server", server_nonce, client_nonce))):
        raise AuthError("the receiver did not prove the cluster secret")
    return MessageMacs(derive(key, b"session", server_nonce, client_nonce), is_server=False)


class MessageMacs:
    """One authenticated connection's MACs, one end of it: `seal` what this end sends, `open`
    what it receives. A frame is [seq, body, mac], mac = HMAC-SHA256(session_key, direction |
    seq (8 bytes, big-endian) | body); each direction counts its own seq from 0, so a replayed,
    dropped or reordered frame is out of sequence, and direction keeps a frame from being
    reflected back to its sender. Not thread-safe: each end sends from one thread at a time."""

    def __init__(self, session_key: bytes, is_server: bool):
        self.key = session_key
        self.send_dir, self.recv_dir = (b"s", b"c") if is_server else (b"c", b"s")
        self.send_seq = self.recv_seq = 0

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.digest(self.key, direction + _SEQ.pack(seq) + body, "sha256")

    def seal(self, body: bytes) -> list:
        """The frame that carries `body` (a packed message) next."""
        seq, self.send_seq = self.send_seq, self.send_seq + 1
        return [seq, body, self._mac(self.send_dir, seq, body)]

    def open(self, frame) -> bytes:
        """The body of `frame`, the next one received; AuthError when it is no frame, its MAC is
        wrong, or it is not the next in sequence."""
        if not (isinstance(frame, list) and len(frame) == 3 and type(frame[0]) is int and 0 <= frame[0] < 2**64
                and isinstance(frame[1], bytes) and isinstance(frame[2], bytes)):
            raise AuthError(f"not an authenticated frame: {type(frame).__name__}")
        seq, body, mac = frame
        if not hmac.compare_digest(mac, self._mac(self.recv_dir, seq, body)):
            raise AuthError(f"message {seq}: wrong MAC")
        if seq != self.recv_seq:
            raise AuthError(f"message {seq} out of sequence (expected {self.recv_seq}): replayed or reordered")
        self.recv_seq += 1
        return body
