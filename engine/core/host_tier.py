"""A host-memory tier under an instance's KV pool (issue 51; vLLM's offloading connector, SGLang's
HiCache L2): a full block the prefix cache evicts is copied to a slot of a host arena first, and a
later prompt whose next blocks are there has them copied back instead of computed.

The bookkeeping is rank 0's (here, beside the block allocator); the copies are every rank's, each
of its own heads (engine/runner/host_arena.py), made at the start of the step the scheduler builds,
before its forward pass writes anything:

    schedule():  pool eviction -> on_evict -> an offload (block -> slot) queued
                 admission     -> claim(hashes) ... reload(keys, block ids): a reload (slot -> block)
    take() -> (offloads, reloads) -> SchedulerOutput -> ModelInput -> runner: offloads, then reloads

Offloads go first: a block a reload overwrites may be one this step evicted (its old contents
leave first). A slot a reload reads is pinned until `take`, so no offload of the same step takes
it. The arena keeps a block after reloading it (as vLLM's CPU tier does): evicted again, it costs
no copy. Least recently used slots go first when the arena is full. Only group 0's keys (plain
ints) are taken: the tier runs with one KV group (engine/core/block_manager.py keys).

Write-through (`write_through()`, a decode instance's tier): every full block the pool caches is
copied to the tier as well, once its KV is complete, so an eviction later costs no copy. A decode
instance needs it: its reservations evict blocks that the KV transfer writes at once, before any
step could offload them, so without it the tier would hold only what its steps evicted. A block
cached during a step's scheduling is computed by that step: its copy is queued one step later (the
second `take` after it was cached), and the pool keeps it (a reference of the tier's) until the step
that copies it has ended (`release_copied`), so no reservation takes it meanwhile (so is a reload's
block, which a reservation may queue long before a step runs: its request aborted meanwhile, the
block must not be handed out, and written, before the reload lands in it). A block whose
copy is still to be queued is given up when the pool is short (`drop_uncopied`, from an allocation
that would fail otherwise): an idle instance (no step, so no copy) never refuses for them.

A disk tier under it (`disk`, engine/runner/disk_tier.py: one rank's; it reads and writes the slots
itself, at once): a slot the full tier takes back is first written to disk, and `claim` reads a
block the disk holds into a slot, both as the scheduler builds a step (never while one runs: a
decode instance's reservation claims host slots only). A slot a queued offload will fill is never
given to a disk read (the offload would overwrite it); taken back in the same step for another
offload, its block goes to disk from the pool block it was to be copied from (intact until the
step runs), and its copy is cancelled. With every slot pinned, an evicted block goes straight to
disk likewise, and a claimed one comes straight from it: read into memory, copied into its new
pool block by `reload` (so a prompt gets back more blocks from disk than the tier has slots).

Events (engine/core/kv_events.py): a block the pool evicts into the tier stays held for the
router's index, at the level it now lives (`moved`: host, or disk), and moves again as the tiers
move it (a slot spilled to disk, a disk block read into a slot); it is `removed` when no level
holds it any more. A write-through tier (a decode instance's) reports no disk level: its
reservations claim host slots only, so what its disk holds is no hit for a remote request.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.core.kv_events import DISK, HOST

if TYPE_CHECKING:
    from engine.core.block_manager import Block, BlockPool, KVCacheManager
    from engine.core.request import Request


class DiskBooks(Protocol):
    """What the host tier asks of a disk tier under it (engine/runner/disk_tier.py DiskTier)."""
    on_forget: Callable[[int], None] | None

    def has(self, key: int) -> bool: ...
    def spill(self, key: int, slot: int) -> bool: ...
    def spill_block(self, key: int, block_id: int) -> bool: ...
    def load(self, key: int, slot: int) -> bool: ...
    def read(self, key: int) -> list | None: ...
    def write_block(self, block_id: int, tensors: list) -> None: ...
    def clear(self) -> None: ...
    def figures(self) -> dict[str, float]: ...


class HostTier:
    def __init__(self, num_slots: int, pool: BlockPool, disk: DiskBooks | None = None):
        assert num_slots > 0
        self.num_slots, self.pool, self.disk = num_slots, pool, disk
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots a queued reload reads
        self._filling: dict[int, int] = {}  # slot -> the pool block a queued offload copies into it
        self._offloads: list[tuple[int, int]] = []  # (block id, slot), this step's
        self._reloads: list[tuple[int, int]] = []  # (slot, block id), this step's
        self._direct: dict[int, list] = {}  # claimed blocks read from disk with every slot pinned: their tensors
        self._paused = False
        # write-through: blocks cached since the last take; cached before it (copied at the next);
        # being copied by the step in flight. Each holds a reference until that step has ended.
        self._stored: list[Block] = []
        self._ready: list[Block] = []
        self._reloading: list[Block] = []  # the blocks of the reloads queued (any tier), held likewise
        self._copying: list[Block] = []  # the step in flight's: both kinds
        self.serves_disk = True  # what the disk holds is a hit for the requests it admits (the index's level)
        self.stats = {"offloaded_blocks": 0, "reloaded_blocks": 0, "dropped_blocks": 0, "write_through_skipped": 0}
        pool.on_evict = self._offload
        if disk is not None:
            disk.on_forget = self._settle  # the disk let a block go

    def write_through(self) -> None:
        """From now on every block the pool caches is copied here too (the module's docstring)."""
        self.pool.on_store = self._store
        self.serves_disk = False  # a decode instance's reservations claim host slots only

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    def figures(self) -> dict[str, float]:
        """For the instance's load report (gateway/metrics.py)."""
        return {"kv_host_tier_blocks": float(self.num_blocks), "kv_host_tier_slots": float(self.num_slots),
                **{f"kv_host_tier_{k}": float(v) for k, v in self.stats.items()},
                **(self.disk.figures() if self.disk is not None else {})}

    @contextlib.contextmanager
    def paused(self):
        """Evictions meanwhile are not offloaded: their blocks may be written before the next step
        (a decode instance's reservation: the KV transfer writes them at once)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _offload(self, block: Block) -> bool:
        """The pool evicts `block`: True when the tier holds (or from this step will hold) its KV."""
        key = block.block_hash
        if key in self._slots:  # reloaded earlier and kept: nothing to copy
            self._slots.move_to_end(key)
        elif type(key) is not int:
            return False
        elif self.disk is not None and self.disk.has(key):  # on disk since (it came back from there)
            pass
        elif self._paused:
            return False
        elif (slot := self._take_slot()) is None:  # every slot pinned: straight to disk, while the block holds it
            if self.disk is None or not self.disk.spill_block(key, block.block_id):
                return False
        else:
            self._slots[key] = slot
            self._filling[slot] = block.block_id
            self._offloads.append((block.block_id, slot))
            self.stats["offloaded_blocks"] += 1
        self._settle(key)
        return True

    def _store(self, block: Block) -> None:
        """The pool cached `block` (write-through): its copy is queued by the take after next."""
        key = block.block_hash
        if key in self._slots:  # the tier has it already (it was reloaded from here)
            self._slots.move_to_end(key)
        elif type(key) is int:
            self.pool.touch([block])
            self._stored.append(block)

    def _write_through(self) -> None:
        """Queue the copies of the blocks cached before the last take; hold them through this step."""
        for block in self._ready:
            key = block.block_hash
            if key in self._slots:
                self._slots.move_to_end(key)
            elif (slot := self._take_slot()) is not None:
                self._slots[key] = slot
                self._filling[slot] = block.block_id
                self._offloads.append((block.block_id, slot))
                self.stats["offloaded_blocks"] += 1
        self._copying, self._ready, self._stored = self._ready + self._reloading, self._stored, []
        self._reloading = []

    @property
    def held_block_ids(self) -> set[int]:
        """Blocks the tier keeps in the pool for their write-through copies (each one reference)."""
        return {b.block_id for b in self._stored + self._ready + self._reloading + self._copying}

    def release_copied(self) -> None:
        """The step that took the last write-through copies has ended, on every rank: their blocks go."""
        self.pool.free_blocks(self._copying)
        self._copying = []

    def drop_uncopied(self) -> bool:
        """The pool is short: the blocks whose write-through copy no step has taken yet are released,
        their copies forgotten (a step in flight never reads them). Returns whether any was."""
        dropped, self._ready, self._stored = self._ready + self._stored, [], []
        self.pool.free_blocks(dropped)
        self.stats["write_through_skipped"] += len(dropped)
        return bool(dropped)

    def drop_pending(self) -> None:
        """Forget every copy not made yet and release its block (a prefix cache reset when no step is
        in flight and no request holds a block: no block may stay referenced)."""
        self.release_copied()
        self.drop_uncopied()
        self.pool.free_blocks(self._reloading)
        self._reloading, self._reloads = [], []
        self._direct.clear()
        self._pinned.clear()

    def _take_slot(self, now: bool = False) -> int | None:
        """A free slot, else the least recently used one no queued reload reads, its block written to
        the disk tier first (from the pool block it was to be copied from, when that copy is still
        queued: it is cancelled), or dropped without one. `now`: the caller writes the slot at once
        (a disk read), so not a slot a queued offload will write later."""
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # least recently used first
            if slot in self._pinned or (now and slot in self._filling):
                continue
            del self._slots[key]
            if slot in self._filling:  # its copy is still queued: the block is in the pool, not here yet
                block_id = self._filling.pop(slot)
                self._offloads.remove((block_id, slot))
                self.stats["offloaded_blocks"] -= 1  # a copy that will not be made
                kept = self.disk is not None and self.disk.spill_block(key, block_id)
            else:
                kept = self.disk is not None and self.disk.spill(key, slot)
            if not kept:
                self.stats["dropped_blocks"] += 1
            self._settle(key)
            return slot
        return None

    def _settle(self, key: int) -> None:
        """A level gained or lost `key`: the index hears of its fastest level now, or of its
        removal, unless the pool holds it (its `stored` stands)."""
        if self.pool.get_cached_block(key) is not None:
            return
        if key in self._slots:
            self.pool.events.moved(key, HOST)
        elif self.serves_disk and self.disk is not None and self.disk.has(key):
            self.pool.events.moved(key, DISK)
        else:
            self.pool.events.removed(key)

    def _from_disk(self, key: int) -> int | None:
        """A slot holding the block `key`, read from the disk tier, or None."""
        slot = self._take_slot(now=True)
        if slot is None:
            return None
        if not self.disk.load(key, slot):
            self._free.append(slot)
            return None
        self._slots[key] = slot  # (counted by the disk tier: loaded_blocks)
        self._settle(key)
        return slot

    def claim(self, hashes: list[int], from_disk: bool = True) -> list[int]:
        """The leading `hashes` (a prompt's next full blocks after its pool hits) the tier holds,
        pinned until `take` (or `release`): pass them to `reload` once their blocks are allocated.
        With `from_disk`, blocks on the disk tier are read into slots first (no step may be running),
        or, once every slot is pinned by this claim, into memory, copied straight into their pool
        blocks by `reload`."""
        keys = []
        for key in hashes:
            slot = self._slots.get(key)
            if slot is None and from_disk and self.disk is not None and self.disk.has(key):
                slot = self._from_disk(key)
                if slot is None and self.disk.has(key) and (tensors := self.disk.read(key)) is not None:
                    self._direct[key] = tensors  # (a refused file is no longer `has`)
                    keys.append(key)
                    continue
            if slot is None:
                break
            self._slots.move_to_end(key)
            self._pinned.add(slot)
            keys.append(key)
        return keys

    def release(self, keys: list[int]) -> None:
        """The claim was not used (the request did not fit)."""
        for key in keys:
            if self._direct.pop(key, None) is None:
                self._pinned.discard(self._slots[key])

    def reload(self, keys: list[int], block_ids: list[int]) -> None:
        """Copy the claimed `keys` into the blocks `block_ids` at the start of this step (those read
        into memory, now: no step is running)."""
        assert len(keys) == len(block_ids)
        for key, block_id in zip(keys, block_ids):
            if (tensors := self._direct.pop(key, None)) is not None:
                self.disk.write_block(block_id, tensors)
            else:
                self._reloads.append((self._slots[key], block_id))
        blocks = [self.pool.blocks[i] for i in block_ids]
        self.pool.touch(blocks)  # held until the step that reloads them has ended
        self._reloading += blocks
        self.stats["reloaded_blocks"] += len(keys)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (offloads, reloads); the pins end. Called as a step that runs (one with
        requests: an empty one makes no copy) is scheduled, so the previous one has ended: its
        write-through copies are made and their blocks released."""
        self.release_copied()  # if the worker did not say so as the step ended
        self._write_through()
        out, self._offloads, self._reloads = (self._offloads, self._reloads), [], []
        assert not self._direct, "a claim neither reloaded nor released"
        self._pinned.clear()
        self._filling.clear()  # the step these go to runs before any slot is taken again
        return out

    def clear(self) -> None:
        """Forget every block (the pool's prefix cache was reset), the disk tier's files too."""
        if self.disk is not None:
            self.disk.clear()
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self._direct.clear()

    # -- a scheduler's admission ------------------------------------------------------------------
    def claim_for(self, kv: KVCacheManager, request: Request, num_hit: int, from_disk: bool = True) -> list[int]:
        """The request's full prompt blocks after its `num_hit` pool-hit tokens that the tier holds,
        leading ones only and leaving its last token to compute (as get_computed_blocks)."""
        hashes = kv.req_to_block_hashes.get(request.request_id, [])[:(request.num_tokens - 1) // kv.block_size]
        return self.claim(hashes[num_hit // kv.block_size:], from_disk)

    def reload_for(self, kv: KVCacheManager, request: Request, keys: list[int], num_hit: int) -> None:
        """After the request's blocks are allocated: its claimed blocks come back from the tier."""
        first = num_hit // kv.block_size
        self.reload(keys, kv.get_block_ids(request.request_id)[0][first:first + len(keys)])
