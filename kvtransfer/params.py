"""Typed data that crosses process boundaries for KV transfer: who talks to whom, and whether
their KV layouts agree. No block ids: the receiver owns the mapping from request to slots.

The plan (`plan_head_slices`, `expected_parts`): which prefill rank sends which KV heads to which decode
rank (heterogeneous TP).

Example: 4 KV heads, prefill tp=1, decode tp=2      prefill tp=2, decode tp=1
    P0 [h0 h1 h2 h3]                                   P0 [h0 h1]   P1 [h2 h3]
        |  |   \\  \\                                      \\  /         \\  /
    D0 [h0 h1]  D1 [h2 h3]                                 D0 [h0 h1 h2 h3]
Each decode rank's heads come from the lowest prefill rank holding them (a replicated head is
sent once). Decode rank 0 always gets a part from prefill rank 0, which carries the trailer (base.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

PROTOCOL_VERSION = 18  # 3: control messages on TCP, payloads alone on the data channel; 4: runs; 5: shared caches;
# 6: kv_window (a sliding-window model ships only the tokens its decode can still read); 7: kv_layout (a
# transfer per KV group, num_layers its slabs); 8: done.more_choices (n > 1: every choice's first token);
# 9: kv_checksum (done.checksum, kvtransfer/wire.py); 10: a shared part's `ready` grants its slots until
# `done` (no layer/grant/wrote per span), welcome.data_channel and no_cache_reason (no NCCL on one GPU);
# 11: kv_format (what a KV head holds: per-head K/V, or DeepSeek's latent entry); 12: speculative (informational);
# 13: proposer_rows (a speculative proposer's state of the prompt, `rows` messages before `done`); 14: the control
# channel is authenticated (control.py: a handshake before `hello`, every message in a MAC'd frame), so an older
# peer never gets as far as comparing this: it is refused at the handshake, or its handshake times out;
# 15: a rendezvous store per connection (welcome.store_prefix, rendezvous.py) and payload MACs (done.mac);
# 16: the payload MAC is keyed BLAKE3 (was keyed BLAKE2b); 17: a part ends with an opaque trailer (`trailer`
# chunks, done.trailer_bytes; the instance layer's, compat.trailer_format) in place of the first token's fields;
# 18: begin.trace (a W3C traceparent or "": the request's trace crosses the control channel, engine/core/tracing.py)


@dataclass(frozen=True)
class CompatRecord:
    """What both ends of a KV transfer must agree on; exchanged in the handshake.

    `block_size` and `tp_size` are informational (no block ids cross the wire and the sender
    slices heads per decode rank), so they may differ; everything in MUST_MATCH may not.
    `dtype` is the KV cache's element type ("float8_e4m3fn" for an fp8 cache), which may differ
    from the model's. `num_layers` is the layers one transfer carries: a KV group's (its slabs;
    every layer, with one group), and `kv_layout` the groups' windows and sizes (KVLayout.signature).
    `kv_checksum`: every part carries a checksum of its payloads, checked on receipt (wire.py);
    both ends must agree, since a receiver that checks needs one in every `done`. `kv_format` names
    what a KV head's two planes hold: "kv" (a head's keys and values), or for DeepSeek's latent
    attention "mla:<kv_lora_rank>+<qk_rope_head_dim>" (one head, a token's entry in two halves:
    engine/layers/mla.py), which every decode rank receives whole.
    `trailer_format` names what a part's trailer holds (base.py: bytes carried unread); the
    instance layer that packs and unpacks it names it (engine/core/request.py), so both ends must agree.
    NOTE: fp8 scales are not here because they are 1.0 on every instance (engine/models/llama.py); a
    change that loads them from checkpoints must add them to MUST_MATCH.
    """
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 0
    tp_size: int = 1
    device_type: str = "cpu"
    kv_layout: str = ""  # KVLayout.signature: both ends cut a prompt's KV to the same groups and tokens
    kv_checksum: bool = False  # done carries a checksum of the part's payloads (--kv-checksum)
    kv_format: str = "kv"  # what a KV head holds (docstring)
    trailer_format: str = ""  # what a part's trailer holds, named by the instance layer (docstring)
    protocol_version: int = PROTOCOL_VERSION

    MUST_MATCH = ("protocol_version", "model", "dtype", "num_layers", "num_kv_heads", "head_dim", "device_type",
                  "kv_layout", "kv_checksum", "kv_format", "trailer_format")

    def __post_init__(self):
        assert self.num_layers > 0 and self.num_kv_heads > 0 and self.head_dim > 0, self
        assert isinstance(self.kv_checksum, bool), self

    def mismatch(self, other: CompatRecord) -> str | None:
        """A readable description of every disagreeing field, or None when compatible."""
        diffs = [f"{k}: {getattr(self, k)!r} here vs {getattr(other, k)!r} at the peer"
                 for k in self.MUST_MATCH if getattr(self, k) != getattr(other, k)]
        return "; ".join(diffs) or None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> CompatRecord:
        """Raises ValueError on anything but a dict with exactly the known fields."""
        if not isinstance(d, dict):
            raise ValueError(f"compat record must be a map, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        if set(d) - names or {"model", "dtype", "num_layers", "num_kv_heads", "head_dim"} - set(d):
            raise ValueError(f"compat record has fields {sorted(d)}, expected {sorted(names)}")
        try:
            return cls(**d)
        except (TypeError, AssertionError) as exc:
            raise ValueError(f"bad compat record {d!r}: {exc}") from None


@dataclass(frozen=True)
class KVEndpoint:
    """Where one decode rank listens for KV (its TCPStore)."""
    instance_id: str
    rank: int
    host: str
    port: int

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


@dataclass(frozen=True)
class Reservation:
    """A decode instance's yes to a remote request (DecodeClient.reserve): its prompt's blocks are
    reserved, and its prefix cache already holds the first `cached_tokens` prompt tokens (a multiple
    of its block size, fewer than the prompt), so only the tokens after them are shipped."""
    cached_tokens: int = 0


@dataclass(frozen=True)
class KVTransferParams:
    """Travels with a request from the router to its prefill instance: where its KV goes, and from
    which prompt token (`decode_cached_tokens`: what the decode instance's cache holds, Reservation)."""
    request_id: str
    decode_instance_id: str
    decode_tp_size: int
    endpoints: tuple[KVEndpoint, ...]  # one per decode rank, in rank order
    decode_cached_tokens: int = 0
    trace_context: str = ""  # the traceparent of the prefill's kv.transfer span: in each part's `begin` ("": none)
    cache_salt: str | None = None  # a fetch's: the salt the held blocks are hashed under (ship_held)

    def __post_init__(self):
        assert len(self.endpoints) == self.decode_tp_size, self
        assert [e.rank for e in self.endpoints] == list(range(self.decode_tp_size)), self
        assert self.decode_cached_tokens >= 0, self


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` of a `tp_size` group holds (as QKVParallelLinear shards them).

    tp <= heads: a contiguous slice of heads / tp heads.
    tp >  heads: one head, replicated on tp / heads consecutive ranks.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a group of {tp_size}")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"tp {tp_size} is not a multiple of {num_kv_heads} KV heads")
        head = rank // (tp_size // num_kv_heads)
        return range(head, head + 1)
    if num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split over tp {tp_size}")
    per = num_kv_heads // tp_size
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class HeadSlice:
    prefill_rank: int
    decode_rank: int
    head_start: int  # global KV head index, inclusive
    head_end: int    # exclusive

    def __post_init__(self):
        assert 0 <= self.head_start < self.head_end, self


def _holder(head: int, num_kv_heads: int, prefill_tp: int) -> int:
    return next(p for p in range(prefill_tp) if head in kv_heads_of_rank(num_kv_heads, prefill_tp, p))


def plan_head_slices(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadSlice]:
    """Every (prefill rank, decode rank, contiguous head range) part of one request's transfer."""
    out: list[HeadSlice] = []
    for d in range(decode_tp):
        heads = kv_heads_of_rank(num_kv_heads, decode_tp, d)
        start = heads.start
        for h in heads:
            if h + 1 == heads.stop or _holder(h + 1, num_kv_heads, prefill_tp) != _holder(h, num_kv_heads, prefill_tp):
                out.append(HeadSlice(_holder(h, num_kv_heads, prefill_tp), d, start, h + 1))
                start = h + 1
    assert any(s.prefill_rank == 0 and s.decode_rank == 0 for s in out)
    return out


def expected_parts(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """How many parts decode rank `decode_rank` receives for one request."""
    return sum(s.decode_rank == decode_rank for s in plan_head_slices(num_kv_heads, prefill_tp, decode_tp))
