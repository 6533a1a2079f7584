"""KV an instance holds, shipped for another instance's fetch (`ship_held`, issue 51 item 3), the
same way for a prefill and a decode instance: rank 0 holds the prefix's blocks as a request of
their own in its KV manager (pool hits, then, where the instance lets it, what its host or disk tier
holds after them, reloaded into blocks allocated for it: disk reads first, on every rank, while steps
run), queues a shipment that the next step
carries to every rank, and frees the blocks once the transfer ended; every rank ships its heads of
every layer from its cache through a PrefillConnector, with no forward pass.

    rank 0:      hold(kv, request, tokens, params) -> None | why not    take() -> the step's shipments
                 delivered(request, error) -> True for a held one (its blocks freed)
    every rank:  ship(shipments, kv_cache)
"""
from __future__ import annotations

import logging

import torch

from engine.core.block_manager import KVCacheManager
from engine.core.request import Request, SamplingParams
from kvtransfer.connector import PrefillConnector, Shipment, prompt_slots
from kvtransfer.params import KVTransferParams

logger = logging.getLogger(__name__)


class HeldKV:
    def __init__(self, connector: PrefillConnector, num_layers: int, num_groups: int, device: torch.device,
                 instance_id: str, from_tiers: bool = True):
        """`connector`: the rank's sender end; `from_tiers`: the blocks a tier holds may be reloaded
        to be shipped (a prefill instance's: its steps make the copies; a decode instance ships
        from its pool alone)."""
        self.connector, self.num_layers, self.num_groups, self.device = connector, num_layers, num_groups, device
        self.instance_id, self.from_tiers = instance_id, from_tiers
        self._queued: list[Shipment] = []
        self._holding: dict[str, tuple[KVCacheManager, Request]] = {}  # request id -> what holds its blocks
        self._reading: dict[str, tuple[KVCacheManager, Request, KVTransferParams]] = {}  # waiting for disk reads

    def hold(self, kv: KVCacheManager, request_id: str, token_ids: list[int], params: KVTransferParams) -> str | None:
        """Rank 0: holds the blocks of `token_ids` and queues their shipment from
        `params.decode_cached_tokens` on. None, or why nothing is held (then nothing ships). Blocks
        only its disk tier holds are read first (every rank, while steps run): the shipment is
        queued by the `retry` after they landed, or given up (logged) if a read failed."""
        size, n = kv.block_size, len(token_ids)
        if self.num_groups > 1:
            return "cannot ship the held prefix: a model of several KV groups (sliding windows) ships no held blocks"
        if not n or n % size or not params.decode_cached_tokens < n:
            return f"cannot ship the held prefix: {n} tokens from {params.decode_cached_tokens}: not whole blocks of {size} past it"
        if request_id in self._holding or request_id in self._reading:
            return f"cannot ship the held prefix: {request_id} is already shipping"
        # its own id (the instance may hold the fetching request itself: a decode instance reserved it);
        # one token more: every given block is then a full block before the last token, as a prompt's hits are
        # (a salted prompt's blocks are found under its salt: SamplingParams.cache_salt)
        held = Request(f"{request_id}#held", [*token_ids, token_ids[-1]], SamplingParams(cache_salt=params.cache_salt))
        return self._hold(kv, request_id, held, params)

    def _hold(self, kv: KVCacheManager, request_id: str, req: Request, params: KVTransferParams) -> str | None:
        size, n = kv.block_size, req.num_tokens - 1
        hit_blocks, num_hit = kv.get_computed_blocks(req)
        tier = kv.tier if self.from_tiers else None
        keys = tier.claim_for(kv, req, num_hit) if tier is not None else []
        if keys is None:  # some of its blocks are being read from disk: tried again before each step
            kv.free(req)
            self._reading[request_id] = (kv, req, params)
            return None
        if num_hit + len(keys) * size < n or \
                kv.allocate_slots(req, n - num_hit, hit_blocks, num_tokens_to_cache=n) is None:
            kv.free(req)  # forget the hashes get_computed_blocks computed
            if tier is not None:
                tier.release(keys)
                tier.forget(req.request_id)
            return f"cannot ship the held prefix: holds fewer than its {n // size} blocks, or no room to reload them"
        if tier is not None:
            tier.reload_for(kv, req, keys, num_hit)
        self._holding[request_id] = (kv, req)
        slots = prompt_slots(kv.get_block_ids(req.request_id)[0], size, n, self.device, params.decode_cached_tokens)
        self._queued.append(Shipment(request_id, params, n - params.decode_cached_tokens, slots))
        return None

    def retry(self) -> None:
        """Rank 0, before the step is scheduled: the holds whose disk reads have landed are queued
        (or, a read having failed, given up: the fetcher computes the prefix when its wait ends)."""
        for request_id, (kv, req, params) in list(self._reading.items()):
            del self._reading[request_id]
            if (why := self._hold(kv, request_id, req, params)) is not None:
                logger.warning("%s: held KV of %s not shipped after its disk reads: %s", self.instance_id,
                               request_id, why)

    def take(self) -> list[Shipment]:
        """Rank 0: the shipments the next step carries (to every rank)."""
        out, self._queued = self._queued, []
        return out

    def ship(self, shipments: list[Shipment], kv_cache: torch.Tensor) -> None:
        """Every rank, in the step that carries them: each shipment's KV leaves, every layer."""
        if not shipments:
            return
        self.connector.start(shipments)
        for layer in range(self.num_layers):
            self.connector.save_layer(layer, kv_cache)
        for s in shipments:
            self.connector.finish(s.request_id)

    def delivered(self, request_id: str, error: str | None) -> bool:
        """Rank 0: a transfer of the connector ended; for a held one (True) its blocks are let go (a
        failed one is the fetcher's to compute: logged here)."""
        held = self._holding.pop(request_id, None)
        if held is None:
            return False
        kv, req = held
        kv.free(req)
        if error:
            logger.warning("%s: held KV of %s not delivered: %s", self.instance_id, request_id, error)
        return True

    @property
    def busy(self) -> bool:
        """Shipments queued for the next step, or holds waiting for their disk reads."""
        return bool(self._queued or self._reading)
