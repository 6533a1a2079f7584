"""What crosses between a prefill rank and a decode rank besides KV, and how it is trusted: the control
messages, the payloads' checksums and MACs, and the control channel's authentication.

The KV connector's control messages: msgpack maps on a TCP connection (control.py), never on
the data plane, which carries only KV payloads (channel.py).

One control connection per (prefill rank, decode rank) pair; its data channel is built after
the handshake. Each message below travels in a MAC'd frame, after both ends proved the cluster
secret (control.py's docstring: the authentication handshake and the frames).
Sender -> receiver, with the receiver's answer:

    hello  {sender_id, compat, device_key}              -> welcome {ok, error, compat, store_port, store_prefix,
                                                                    channel, cache, data_channel, no_cache_reason}
    join   {channel, shared}                               (no answer: both ends build the data channel; or,
                                                           shared, the sender opened `cache`: no data channel)
    begin  {request_id, head_start, head_end, num_tokens, trace} -> ready {request_id, ok, error, runs, slots}
    layer  {request_id, head_start, layer, count}          (no answer) then, for each of layers [layer,
                                                           layer + count), its payload on the data channel:
                                                           runs == []: K and V of the part's heads as one
                                                           message, (2, tokens, heads, head_dim);
                                                           else per run [start, length]: K[start:start+length],
                                                           then V[start:start+length], each a message
    trailer {request_id, head_start, data}                (no answer; a chunk of the part's trailer, base.py: bytes
                                                           this transport carries unread; in order, just before
                                                           its `done`, each at most TRAILER_CHUNK_BYTES; none
                                                           for an empty trailer)
    done   {request_id, head_start, num_layers, trailer_bytes, checksum, mac}
                                                        -> ack {request_id, ok, error}

store_port, store_prefix: where `join` builds the data channel, a store made for this connection
on the receiver's host (rendezvous.py), and its random key prefix; 0 and "" when refused.
device_key: the sender's shared_cache.device_key ("" when unknown). data_channel: which channel
`join` builds (channel.py: data_channel_kind): "gloo", "nccl", or "host" (gloo through host
memory) for two ranks of one GPU. cache: the receiver's cache (shared_cache.py), offered to a
sender on its device; else nil, and for a sender on its device no_cache_reason says why.

On a shared connection (the sender opened `cache`) no payload moves on a data channel and no
message goes per layer: `ready` {ok: true} grants the part's slots to the sender, which writes
every layer into them itself; they are its to write until its `done`, which it sends once the
copies are complete (so a cancel waits for that `done`). `layer` is garbage there. The receiver
reads layers 0 .. num_layers - 1 back for a checksum.

The receiver answers `ready` only for a request it has reserved slots for, and posts a receive
on the data channel only after a `layer` announced its payload: no receive waits unmatched.
A `layer` message announces the layers queued at the sender when it is sent (one, when the
model computes slower than the link moves; several, when the link is behind: fewer messages).
`runs` are where the reserved slots are contiguous in the receiver's cache (they tile the part's
tokens in order): the receiver receives each run straight into the cache; [] when there are too
many runs to pay off, or the part has some of the rank's heads only (it receives one buffer and
scatters it). On a shared connection `runs` always tile the part and `slots` holds each run's
first slot in the receiver's cache ([] on other connections).
trailer_bytes: the length of the trailer its `trailer` chunks carried (a mismatch is a malformed message).
checksum: with `kv_checksum` in both ends' CompatRecord (--kv-checksum), the part's xxh3_64
(below) over its payload bytes in the order they cross: per announced layer, the one
message, or K then V of each run; on a shared connection, per layer, the bytes written as the
sender held them, (2, tokens, heads, head_dim), which the receiver reads back from its slots at `done`.
nil without kv_checksum; either way round is a malformed message. A mismatch fails the part:
ack {ok: false}. mac: on an authenticated connection with a data channel, the part's keyed
BLAKE3 (PartMac, below) over the same bytes as the checksum; nil on a shared connection
(or with payload MACs off: bench only); a missing, extra or wrong one fails the part likewise.

KV checksums (`--kv-checksum`): one xxh3_64 per part, over its payload bytes in the order they
cross (above: per announced layer, the one message, or K then V of each run), computed by the
sender from the tensors it hands to the channel and by the receiver from what landed (its
buffer, or the cache slots it received straight into), compared at `done`.

Why xxh3_64 (the `xxhash` package) and not CRC32C (the `crc32c` package): both are maintained
and release the GIL, and both are incremental (`update` per payload); on the project's CPU host
xxh3_64 hashes MB-sized buffers about twice as fast (45 GB/s vs 24 GB/s at 1-4 MB, 26 vs 20 at
16 MB; docs/disaggregation.md), and a 64-bit digest misses a random corruption with probability
2^-64 instead of 2^-32. It detects corruption, not forgery: it is no MAC.

Payload MACs (PartMac): whenever the control channel is authenticated (the cluster secret), each
part over a data channel carries a keyed BLAKE3 (the `blake3` package's keyed_hash mode, 256-bit)
of the same bytes in the same order, keyed by the connection's payload key (auth.payload_key of
the control session's key, which only the two ends hold) and bound to the part (request id, first
head, tokens), in `done.mac` on the MAC'd control channel. Bytes injected or altered on the data
channel, or a payload replayed from another part, fail it. Why BLAKE3: its keyed mode is a MAC by
design (no HMAC nesting), incremental, it releases the GIL, and it is the fastest of the three
measured on one core (BENCHMARKS.md, issue 48: 6.6 GB/s at 4 MB against 0.85 for keyed BLAKE2b
and 0.78 for HMAC-SHA256 on a 2-vCPU Xeon with SHA-NI), so the MAC costs the data channel a
fraction of its rate instead of most of it. One thread per hash: the transfer's other work needs
the other cores.

Authentication of the KV control channel (control.py; `cluster_secret`, the handshake, `seal`/`open`):
the cluster secret, the key derived from it, both sides of the handshake (over any connection that sends
and receives msgpack objects) and the per-message MACs. The protocol, and how a refused peer is handled,
are in control.py's docstring; the threat model in docs/security.md.

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
with payload_key(session key) (PartMac), so one connection's payload key says
nothing of another's."""
from __future__ import annotations

import functools
import hmac
import logging
import os
import secrets
import struct

import blake3
import torch
import xxhash

_NONE = type(None)
TRAILER_CHUNK_BYTES = 512 << 10  # of a `trailer` message's data (control.py takes messages up to 1 MiB)
SCHEMA: dict[str, dict[str, type | tuple]] = {
    "hello": {"sender_id": str, "compat": dict, "device_key": str},
    "welcome": {"ok": bool, "error": (str, _NONE), "compat": dict, "store_port": int, "store_prefix": str,
                "channel": int,
                "cache": (dict, _NONE), "data_channel": str, "no_cache_reason": (str, _NONE)},
    "join": {"channel": int, "shared": bool},
    "begin": {"request_id": str, "head_start": int, "head_end": int, "num_tokens": int, "trace": str},
    "ready": {"request_id": str, "ok": bool, "error": (str, _NONE), "runs": list, "slots": list},
    "layer": {"request_id": str, "head_start": int, "layer": int, "count": int},
    "done": {"request_id": str, "head_start": int, "num_layers": int, "trailer_bytes": int,
             "checksum": (int, _NONE), "mac": (bytes, _NONE)},
    "ack": {"request_id": str, "ok": bool, "error": (str, _NONE)},
    "trailer": {"request_id": str, "head_start": int, "data": bytes},
}


class WireError(ValueError):
    """A message that is not well formed."""


def check_message(msg, schema: dict[str, dict[str, type | tuple]]) -> dict:
    """`msg` if it is a map with a "kind" of `schema` and exactly that kind's fields, of those
    types (a bool is no int); WireError naming what is wrong otherwise."""
    if not isinstance(msg, dict) or msg.get("kind") not in schema:
        raise WireError(f"unknown message {str(msg)[:80]!r}")
    spec = schema[msg["kind"]]
    if set(msg) != {"kind", *spec}:
        raise WireError(f"{msg['kind']} message has fields {sorted(msg)}, wants {sorted(spec)}")
    for name, typ in spec.items():
        value = msg[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise WireError(f"{msg['kind']}.{name} has type {type(value).__name__}")
    if msg["kind"] == "done" and msg["trailer_bytes"] < 0:
        raise WireError("done.trailer_bytes is negative")
    if msg["kind"] == "trailer" and not 0 < len(msg["data"]) <= TRAILER_CHUNK_BYTES:
        raise WireError(f"trailer chunk of {len(msg['data'])} bytes")
    if msg["kind"] == "done" and msg["checksum"] is not None and not _is_u64(msg["checksum"]):
        raise WireError("done.checksum is not an unsigned 64-bit int")
    if msg["kind"] == "ready" and not all(_is_run(run) for run in msg.get("runs", ())):  # (nixl_wire.py: none)
        raise WireError("ready.runs is not a list of [start, length] pairs")
    if msg["kind"] == "ready" and not all(type(slot) is int and slot >= 0 for slot in msg.get("slots", ())):
        raise WireError("ready.slots is not a list of slots")
    return msg


def trailer_messages(request_id: str, head_start: int, trailer: bytes) -> list[dict]:
    """`trailer` as `trailer` messages, in order (none for b"")."""
    view = memoryview(trailer)
    return [{"kind": "trailer", "request_id": request_id, "head_start": head_start,
             "data": bytes(view[i:i + TRAILER_CHUNK_BYTES])} for i in range(0, len(trailer), TRAILER_CHUNK_BYTES)]


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value < 2**64


def _is_run(run) -> bool:
    return isinstance(run, list) and len(run) == 2 and type(run[0]) is int and type(run[1]) is int \
        and run[0] >= 0 and run[1] > 0


def check_runs(runs: list[list[int]], num_tokens: int) -> None:
    """WireError unless `runs` is [] or tiles [0, num_tokens) in order."""
    end = 0
    for start, length in runs:
        if start != end:
            raise WireError(f"runs {runs[:4]}... do not tile {num_tokens} tokens in order")
        end += length
    if runs and end != num_tokens:
        raise WireError(f"runs cover {end} of {num_tokens} tokens")


def payload_bytes(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Size of one layer's payload of a part."""
    return 2 * num_tokens * num_heads * head_dim * dtype.itemsize


def host_bytes(payload: torch.Tensor, ready=None) -> memoryview:
    """`payload`'s bytes (any dtype; made contiguous). A CUDA tensor is copied to the host first,
    once `ready` (the CUDA event recorded when it was computed, or None) has passed: a
    device-to-host copy per payload, the cost of checksums and MACs on a GPU."""
    if payload.is_cuda:
        if ready is not None:
            ready.synchronize()
        payload = payload.cpu()
    return memoryview(payload.contiguous().view(-1).view(torch.uint8).numpy())


class PartChecksum:
    """The running checksum of one part's payloads."""

    def __init__(self):
        self._hash = xxhash.xxh3_64()

    def update(self, payload: torch.Tensor, ready=None) -> None:
        """Adds `payload`'s bytes (host_bytes)."""
        self._hash.update(host_bytes(payload, ready))

    @property
    def value(self) -> int:
        """The digest so far, an unsigned 64-bit int (what `done.checksum` carries)."""
        return self._hash.intdigest()


def checksum_of(payloads) -> int:
    """The checksum of `payloads` (tensors) in that order: what a part of them would carry."""
    c = PartChecksum()
    for p in payloads:
        c.update(p)
    return c.value


_PART = struct.Struct(">qqQ")  # head_start, num_tokens, len(request id): the part a MAC is bound to


class PartMac:
    """The running keyed BLAKE3 of one part's payloads (module docstring), bound to the part:
    equal MACs mean equal bytes, in the same order, of the same (request, head_start, num_tokens),
    under the same key (32 bytes: auth.payload_key's)."""

    def __init__(self, key: bytes, request_id: str, head_start: int, num_tokens: int):
        rid = request_id.encode()
        self._mac = blake3.blake3(_PART.pack(head_start, num_tokens, len(rid)) + rid, key=key)

    def update(self, payload: torch.Tensor, ready=None) -> None:
        """Adds `payload`'s bytes (host_bytes)."""
        self._mac.update(host_bytes(payload, ready))

    @property
    def value(self) -> bytes:
        """The MAC so far (what `done.mac` carries)."""
        return self._mac.digest()

    def verify(self, mac: bytes | None) -> bool:
        """Whether `mac` (the sender's) equals this one, in constant time."""
        return isinstance(mac, bytes) and hmac.compare_digest(mac, self.value)


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
