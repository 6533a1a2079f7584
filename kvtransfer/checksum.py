"""KV checksums (`--kv-checksum`): one xxh3_64 per part, over its payload bytes in the order they
cross (wire.py: per announced layer, the one message, or K then V of each run), computed by the
sender from the tensors it hands to the channel and by the receiver from what landed (its
buffer, or the cache slots it received straight into), compared at `done`.

Why xxh3_64 (the `xxhash` package) and not CRC32C (the `crc32c` package): both are maintained
and release the GIL, and both are incremental (`update` per payload); on the project's CPU host
xxh3_64 hashes MB-sized buffers about twice as fast (45 GB/s vs 24 GB/s at 1-4 MB, 26 vs 20 at
16 MB; docs/disaggregation.md), and a 64-bit digest misses a random corruption with probability
2^-64 instead of 2^-32. It detects corruption, not forgery: it is no MAC.
"""
from __future__ import annotations

import torch
import xxhash


class PartChecksum:
    """The running checksum of one part's payloads."""

    def __init__(self):
        self._hash = xxhash.xxh3_64()

    def update(self, payload: torch.Tensor, ready=None) -> None:
        """Adds `payload`'s bytes (any dtype; made contiguous). A CUDA tensor is copied to the host
        first, once `ready` (the CUDA event recorded when it was computed, or None) has passed: a
        device-to-host copy per payload, the cost of checksums on a GPU."""
        if payload.is_cuda:
            if ready is not None:
                ready.synchronize()
            payload = payload.cpu()
        data = payload.contiguous().view(-1).view(torch.uint8)
        self._hash.update(memoryview(data.numpy()))

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
