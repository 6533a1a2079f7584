"""The `nixl` transport's control messages: wire.py's, on the same authenticated control channel
(control.py), where the receiver reads the KV instead of being sent it.

    hello  {sender_id, compat, agent, pool}            -> welcome {ok, error, compat}
    begin  {request_id, head_start, head_end, num_tokens, source, trace}  -> ready {request_id, ok, error}
    layer  {request_id, head_start, layer, count}        (no answer): layers [layer, layer + count) are in
                                                         the sender's pool; the receiver reads them (NIXL READ)
    trailer {request_id, head_start, data}               (as wire.py: the part's trailer, carried unread)
    done   {request_id, head_start, num_layers, trailer_bytes, checksum, mac}
                                                       -> ack {request_id, ok, error}: sent once every read of
                                                          the part landed (the sender's blocks are free then)

agent: the sender's NIXL agent metadata (its UCX address and the keys of its registered pool):
given only to a receiver that proved the cluster secret, so no one else can read the pool; the
receiver adds it at the hello and removes it when the connection ends. pool: nixl_reads.PoolShape.
source: the part's slots in the sender's pool, (first slot, length) runs as little-endian int64
pairs (scatter.slot_runs' stretches), tiling its tokens in order. checksum: with `kv_checksum`, the
part's xxh3_64 (wire.PartChecksum) over each layer's (2, tokens, heads, head_dim) in token order,
as the sender's pool holds it and as the receiver's slots hold it once read. mac: always nil, no
payload MAC: the bytes move over UCX (docs/security.md, "NIXL").
"""
from __future__ import annotations

import numpy as np

from kvtransfer.wire import SCHEMA, WireError

_NONE = type(None)
NIXL_SCHEMA = SCHEMA | {
    "hello": {"sender_id": str, "compat": dict, "agent": bytes, "pool": dict},
    "welcome": {"ok": bool, "error": (str, _NONE), "compat": dict},
    "begin": {"request_id": str, "head_start": int, "head_end": int, "num_tokens": int, "source": bytes,
              "trace": str},
    "ready": {"request_id": str, "ok": bool, "error": (str, _NONE)},
}
del NIXL_SCHEMA["join"]


def encode_runs(runs: np.ndarray) -> bytes:
    return np.ascontiguousarray(runs, dtype="<i8").tobytes()


def decode_runs(data: bytes, num_tokens: int) -> np.ndarray:
    """(R, 2) runs from `begin.source`; WireError unless they are whole pairs of non-negative
    starts and positive lengths covering `num_tokens` tokens."""
    if len(data) % 16:
        raise WireError(f"begin.source of {len(data)} bytes is no list of int64 pairs")
    runs = np.frombuffer(data, dtype="<i8").reshape(-1, 2).astype(np.int64)
    if runs.size == 0 or (runs[:, 0] < 0).any() or (runs[:, 1] < 1).any() or int(runs[:, 1].sum()) != num_tokens:
        raise WireError(f"begin.source does not tile {num_tokens} tokens")
    return runs
