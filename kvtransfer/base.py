"""The KV transport interface: a prefill rank's `KVSender`, a decode rank's `KVReceiver`, and the
`KVTransport` factory that makes both. torch.distributed is one implementation (`torch_dist.py`);
NIXL or Mooncake would be others behind the same calls, each an entry of registry.py.

A request's transfer to one decode rank is one *part*: the KV heads [head_start, head_end) of
all layers for all of its prompt tokens, in logical token order, then a *trailer*: bytes the
transport carries, authenticated like its control messages, without reading them (what a
request's KV comes with is the instance layer's: engine/core/request.py). A decode rank may receive
several parts of one request (one per prefill rank holding some of its heads); it reports the
request complete when all of them arrived, with the trailer one of them carried (b"" if none did).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtransfer.params import CompatRecord, KVEndpoint

MAX_TRAILER_BYTES = 1 << 30  # of one part's trailer: its peer is authenticated; this bounds a faulty one


class CompletedTransfer(NamedTuple):
    """A request whose KV is all in this rank's cache, and the trailer a part of it carried; the
    traceparent its first part's `begin` carried ("": none) and when that came (time.time_ns())."""
    request_id: str
    trailer: bytes = b""
    trace: str = ""
    began_ns: int = 0


class TransferError(RuntimeError):
    """A transfer failed: dead or silent peer, refused handshake, or a receiver-side error."""


class IncompatiblePeerError(TransferError):
    """The peer's CompatRecord disagrees with ours; nothing was sent."""


class Transfer(ABC):
    """One part in flight. Calls are queued; a background thread does the sending."""

    @abstractmethod
    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        """Queue one layer's KV.

        Args:
            kv: (2, num_tokens, head_end - head_start, head_dim), contiguous, the cache dtype;
                the caller must not modify it afterwards (pass a copy).
        """

    def layer_ready(self, layer: int) -> None:
        """For a sender that `pulls`, in place of send_layer: layer `layer` of the part is in this
        rank's pool (on CUDA: queued on the current stream), where the receiver reads it."""
        raise NotImplementedError(f"{type(self).__name__} sends its layers (send_layer)")

    @abstractmethod
    def finish(self, trailer: bytes = b"") -> None:
        """All layers are queued: the part ends with `trailer` (at most MAX_TRAILER_BYTES), which
        the receiver hands over with the completed request, unread."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the receiver acknowledged the part. Raises TransferError on failure."""


@dataclass(frozen=True)
class KVPool:
    """A rank's KV pool as a transport that reads it in place sees it (`KVSender.pulls`)."""
    cache: torch.Tensor  # (num_slabs, 2, num_blocks, block_size, local kv heads, head_dim), contiguous
    layout: str  # how its blocks' bytes lie: a name in engine/attention BLOCK_LAYOUTS
    head_offset: int  # the global index of its first local KV head


class KVSender(ABC):
    pulls = False  # True: the receiver reads the KV from this rank's pool; its parts take `layer_ready`, not send_layer

    @abstractmethod
    def begin(self, request_id: str, dest: KVEndpoint, head_start: int, head_end: int,
              num_tokens: int, slots: torch.Tensor | None = None, trace: str = "") -> Transfer:
        """Open a part for `request_id` to `dest`: heads [head_start, head_end) of `num_tokens` tokens;
        `slots`: where they lie in this rank's pool, in token order (a sender that `pulls` needs them);
        `trace`: a traceparent its `begin` carries to the receiver (engine/core/tracing.py; "": none)."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: bytes_sent, parts_sent, parts_failed, groups_created, groups_evicted, ..."""

    @abstractmethod
    def close(self) -> None:
        """Drop every connection; later `begin` calls fail."""


class KVReceiver(ABC):
    @property
    @abstractmethod
    def endpoint_address(self) -> tuple[str, int]:
        """(host, port) that senders connect to; published as a KVEndpoint."""

    @abstractmethod
    def expect(self, request_id: str, slots: torch.Tensor, num_parts: int) -> None:
        """Register a request: its KV goes to `slots` (num_tokens,) of this rank's cache, logical
        order; it is complete once `num_parts` parts arrived. KV for unregistered ids is dropped."""

    @abstractmethod
    def poll(self) -> tuple[list[CompletedTransfer], list[tuple[str, str]]]:
        """Returns (completed, failed [(request_id, reason)]) since the last call."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Forget a request; once this returns no more of its KV is written to the cache."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: bytes_received, completed, failed, garbage_messages, unknown_requests, refused_peers
        (incompatible), auth_refused (failed to authenticate: kvtransfer/control.py), kv_checksum_mismatches, ..."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening and drop every connection."""


class KVTransport(ABC):
    name: str

    @abstractmethod
    def sender(self, compat: CompatRecord, sender_id: str, timeout_s: float = 10.0, host: str = "127.0.0.1",
               max_groups: int = 64, same_device: bool = False, pool: KVPool | None = None) -> KVSender:
        """A prefill rank's sending end; `host` is this rank's address as peers see it, and at
        most `max_groups` peer connections stay open (least recently used ones are closed);
        `same_device`: write straight into the caches of receivers on this rank's device; `pool`:
        the rank's KV pool, which a transport whose receivers read it registers."""

    @abstractmethod
    def receiver(self, compat: CompatRecord, kv_cache: torch.Tensor, head_offset: int,
                 host: str = "127.0.0.1", timeout_s: float = 10.0, share_cache: bool = False,
                 kv_views=None, layout: str = "torch") -> KVReceiver:
        """A decode rank's receiving end, writing into `kv_cache`
        (num_layers, 2, num_blocks, block_size, local_kv_heads, head_dim), whose first local head is
        global head `head_offset`; `share_cache`: offer it to senders on the same device
        (on a CPU, it moves into shared memory); `kv_views`: the attention backend's, where the
        blocks are not in the torch layout (then every layer is scattered through them), and
        `layout` their name (engine/attention BLOCK_LAYOUTS)."""
