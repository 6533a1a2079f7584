"""KV checksums (`--kv-checksum`): one xxh3_64 per part, over its payload bytes in the order they
cross (wire.py: per announced layer, the one message, or K then V of each run), computed by the
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
"""
from __future__ import annotations

import hmac
import struct

import blake3
import torch
import xxhash


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
