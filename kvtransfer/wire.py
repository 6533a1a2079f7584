"""The KV connector's control messages: msgpack maps on a TCP connection (control.py), never on
the data plane, which carries only KV payloads (channel.py).

One control connection per (prefill rank, decode rank) pair; its data channel is built after
the handshake. Each message below travels in a MAC'd frame, after both ends proved the cluster
secret (control.py's docstring: the authentication handshake and the frames).
Sender -> receiver, with the receiver's answer:

    hello  {sender_id, compat, device_key}              -> welcome {ok, error, compat, store_port, store_prefix,
                                                                    channel, cache, data_channel, no_cache_reason}
    join   {channel, shared}                               (no answer: both ends build the data channel; or,
                                                           shared, the sender opened `cache`: no data channel)
    begin  {request_id, head_start, head_end, num_tokens} -> ready {request_id, ok, error, runs, slots}
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
(checksum.py) over its payload bytes in the order they cross: per announced layer, the one
message, or K then V of each run; on a shared connection, per layer, the bytes written as the
sender held them, (2, tokens, heads, head_dim), which the receiver reads back from its slots at `done`.
nil without kv_checksum; either way round is a malformed message. A mismatch fails the part:
ack {ok: false}. mac: on an authenticated connection with a data channel, the part's keyed
BLAKE3 (checksum.py PartMac) over the same bytes as the checksum; nil on a shared connection
(or with payload MACs off: bench only); a missing, extra or wrong one fails the part likewise.
"""
from __future__ import annotations

import torch

_NONE = type(None)
TRAILER_CHUNK_BYTES = 512 << 10  # of a `trailer` message's data (control.py takes messages up to 1 MiB)
SCHEMA: dict[str, dict[str, type | tuple]] = {
    "hello": {"sender_id": str, "compat": dict, "device_key": str},
    "welcome": {"ok": bool, "error": (str, _NONE), "compat": dict, "store_port": int, "store_prefix": str,
                "channel": int,
                "cache": (dict, _NONE), "data_channel": str, "no_cache_reason": (str, _NONE)},
    "join": {"channel": int, "shared": bool},
    "begin": {"request_id": str, "head_start": int, "head_end": int, "num_tokens": int},
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
    if msg["kind"] == "ready" and not all(_is_run(run) for run in msg["runs"]):
        raise WireError("ready.runs is not a list of [start, length] pairs")
    if msg["kind"] == "ready" and not all(type(slot) is int and slot >= 0 for slot in msg["slots"]):
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
