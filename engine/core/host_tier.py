"""A host-memory tier under an instance's KV pool (issue 51; vLLM's offloading connector, SGLang's
HiCache L2): a full block the prefix cache evicts is copied to a slot of a host arena first, and a
later prompt whose next blocks are there has them copied back instead of computed.

The bookkeeping is rank 0's (here, beside the block allocator); the copies are every rank's, each
of its own heads (engine/runner/host_arena.py), made at the start of the step the scheduler builds,
before its forward pass writes anything:

    schedule():  pool eviction -> on_evict -> an offload (block -> slot) queued
                 admission     -> claim(hashes) ... reload(keys, block ids): a reload (slot -> block)
    take() -> TierCopies -> SchedulerOutput -> ModelInput -> runner: disk writes, offloads, reloads, ...

Offloads go first: a block a reload overwrites may be one this step evicted (its old contents
leave first). A slot a reload reads is pinned until `take`, so no offload of the same step takes
it. The arena keeps a block after reloading it (as vLLM's CPU tier does): evicted again, it costs
no copy. Least recently used slots go first when the arena is full. With several KV groups (sliding
windows) a block is one group's layers (engine/core/config.py KVLayout), so a slot holds one
group's block; a prompt's next block position comes back only when every group's block of it does.

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

A disk tier under it (`disk`: rank 0's books, engine/runner/disk_tier.py; every rank writes and
reads its own heads' files as the steps say): a slot the full tier takes back is written to disk
first, by the step that overwrites it. A prompt whose next blocks are on disk waits for them
(`claim` answers None, and the scheduler admits others meanwhile): every rank reads them on a
thread of its own while steps run, into memory ("staged"), and once every rank has read and checked
its part, the prompt's next claim takes them, and the step after its blocks are allocated copies
them in (`TierCopies.loads`). A prompt waits once: what its next claim finds (slots, staged) is
reused, the rest computed. A slot a queued offload will fill is never written to disk from the slot
(the offload would land after): taken back in the same step for another offload, its block goes to
disk from the pool block it was to be copied from (intact until the step runs), and its copy is
cancelled. With every slot pinned, an evicted block goes straight to disk likewise.

Events (engine/core/kv_events.py): a block the pool evicts into the tier stays held for the
router's index, at the level it now lives (`moved`: host, or disk), and moves again as the tiers
move it (a slot spilled to disk); it is `removed` when no level
holds it any more. A write-through tier (a decode instance's) reports no disk level: its
reservations claim host slots only, so what its disk holds is no hit for a remote request. A staged
read is no level: it waits for the one prompt that asked for it.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.core.kv_events import DISK, HOST
from engine.core.tier_copies import TierCopies

if TYPE_CHECKING:
    from engine.core.block_manager import Block, BlockPool, KVCacheManager
    from engine.core.request import Request


def is_key(key) -> bool:
    """A block key the tier takes: group 0's chained hash, or (group, hash) (KVCacheManager._key)."""
    return type(key) is int or (type(key) is tuple and len(key) == 2 and all(type(k) is int for k in key))


class DiskBooks(Protocol):
    """What the host tier asks of a disk tier under it (engine/runner/disk_tier.py DiskTier)."""
    on_forget: Callable[[int], None] | None

    def has(self, key: int) -> bool: ...
    def spill(self, key: int, slot: int) -> bool: ...
    def spill_block(self, key: int, block_id: int) -> bool: ...
    def reading(self, key: int) -> bool: ...
    def staged(self, key: int) -> bool: ...
    def fetch(self, keys: list[int]) -> None: ...
    def arrived(self, answers: list[list[tuple[int, str]]]) -> list[int]: ...
    def claim(self, key: int) -> None: ...
    def unclaim(self, key: int) -> None: ...
    def load(self, key: int, block_id: int) -> None: ...
    def drop(self, keys) -> None: ...
    @property
    def busy(self) -> bool: ...
    def take(self) -> tuple[list, list, list, list, bool]: ...
    def clear(self) -> None: ...
    def figures(self) -> dict[str, float]: ...


class HostTier:
    def __init__(self, num_slots: int, pool: BlockPool, disk: DiskBooks | None = None, num_groups: int = 1):
        assert num_slots > 0
        self.num_slots, self.pool, self.disk, self.num_groups = num_slots, pool, disk, num_groups
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots a queued reload reads
        self._filling: dict[int, int] = {}  # slot -> the pool block a queued offload copies into it
        self._offloads: list[tuple[int, int]] = []  # (block id, slot), this step's
        self._reloads: list[tuple[int, int]] = []  # (slot, block id), this step's
        self._claimed_staged: set[int] = set()  # claimed blocks a disk read staged: loaded, not reloaded
        self._waits: dict[str, list[int]] = {}  # request id -> the blocks read from disk for it
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
        elif not is_key(key):
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
        elif is_key(key):
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
        for key in self._claimed_staged:
            self.disk.unclaim(key)
        self._claimed_staged.clear()
        self._pinned.clear()

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one no queued reload reads, its block written to
        the disk tier first (from the pool block it was to be copied from, when that copy is still
        queued: it is cancelled), or dropped without one."""
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # least recently used first
            if slot in self._pinned:
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

    def _keys(self, block_hash: int) -> list:
        """A block position's keys, one per KV group (engine/core/block_manager.py KVCacheManager._key)."""
        return [block_hash] + [(g, block_hash) for g in range(1, self.num_groups)]

    def claim(self, hashes: list[int], waiter: str | None = None) -> list[int] | None:
        """The leading `hashes` (a prompt's next full blocks after its pool hits, group 0's hashes)
        whose blocks the tier holds in every KV group, pinned until `take` (or `release`): pass them
        to `reload` once their blocks are allocated. `waiter` (a request id; None: host slots only):
        blocks of the run that only the disk holds are read first, and the answer is None while they
        are in flight (the request waits, once); then the run's blocks in slots or staged are claimed."""
        disk = self.disk if waiter is not None else None
        if disk is not None:
            pending = self._waits.get(waiter)
            if pending is not None and any(disk.reading(k) for k in pending):
                return None
            if pending is None:
                run = []
                for h in hashes:
                    ks = self._keys(h)
                    if not all(k in self._slots or disk.staged(k) or disk.reading(k) or disk.has(k) for k in ks):
                        break
                    run += ks
                if to_read := [k for k in run if k not in self._slots and not disk.staged(k)]:
                    disk.fetch(to_read)
                    self._waits[waiter] = to_read
                    return None if any(disk.reading(k) for k in to_read) else self.claim(hashes, waiter)
        keys = []
        for h in hashes:
            ks = self._keys(h)
            if not all(k in self._slots or (disk is not None and disk.staged(k)) for k in ks):
                break
            for key in ks:
                slot = self._slots.get(key)
                if slot is not None:
                    self._slots.move_to_end(key)
                    self._pinned.add(slot)
                else:
                    disk.claim(key)
                    self._claimed_staged.add(key)
            keys.append(h)
        return keys

    def release(self, keys: list[int]) -> None:
        """The claim was not used (the request did not fit)."""
        for key in (k for h in keys for k in self._keys(h)):
            if key in self._claimed_staged:
                self._claimed_staged.remove(key)
                self.disk.unclaim(key)
            else:
                self._pinned.discard(self._slots[key])

    def reload(self, keys: list[int], block_ids: Sequence[Sequence[int]]) -> None:
        """Copy the claimed `keys` into the blocks `block_ids` (per KV group, one per key) at the
        start of the next step."""
        assert len(block_ids) == self.num_groups and all(len(ids) == len(keys) for ids in block_ids)
        for g, ids in enumerate(block_ids):
            for h, block_id in zip(keys, ids):
                key = self._keys(h)[g]
                if key in self._claimed_staged:
                    self._claimed_staged.remove(key)
                    self.disk.load(key, block_id)
                else:
                    self._reloads.append((self._slots[key], block_id))
        blocks = [self.pool.blocks[i] for ids in block_ids for i in ids]
        self.pool.touch(blocks)  # held until the step that reloads them has ended
        self._reloading += blocks
        self.stats["reloaded_blocks"] += len(blocks)

    def forget(self, request_id: str) -> None:
        """The request no longer waits (admitted, or gone): the staged reads made for it that no other
        waiting request wants are let go."""
        keys = self._waits.pop(request_id, None)
        if keys and self.disk is not None:
            wanted = {k for ks in self._waits.values() for k in ks}
            self.disk.drop([k for k in keys if k not in wanted])

    def arrived(self, answers: list[list[tuple[int, str]]]) -> None:
        """Every rank's disk reads answered since the last poll (DiskFiles.poll, gathered)."""
        if self.disk is None or not any(answers):
            return
        staged = self.disk.arrived(answers)
        wanted = {k for ks in self._waits.values() for k in ks}
        self.disk.drop([k for k in staged if k not in wanted])

    @property
    def busy(self) -> bool:
        """The disk tier has ops to carry or reads to poll for: a step should run (with nothing to
        compute if need be: the worker then makes the copies itself)."""
        return self.disk is not None and self.disk.busy

    def take(self) -> TierCopies:
        """This step's copies; the pins end. Called as a step that runs is scheduled (one with
        requests, or one the tier needs: `busy`), so the previous one has ended: its write-through
        copies are made and their blocks released."""
        self.release_copied()  # if the worker did not say so as the step ended
        self._write_through()
        out = TierCopies(self._offloads, self._reloads)
        if self.disk is not None:
            out.disk, out.loads, out.drops, out.reads, out.poll = self.disk.take()
        self._offloads, self._reloads = [], []
        assert not self._claimed_staged, "a claim neither reloaded nor released"
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
        self._waits.clear()

    # -- a scheduler's admission ------------------------------------------------------------------
    def claim_for(self, kv: KVCacheManager, request: Request, num_hit: int, from_disk: bool = True) -> list[int] | None:
        """The request's full prompt blocks after its `num_hit` pool-hit tokens that the tier holds,
        leading ones only and leaving its last token to compute (as get_computed_blocks); None: the
        request waits for disk reads (`from_disk`; else host slots only, never None)."""
        hashes = kv.req_to_block_hashes.get(request.request_id, [])[:(request.num_tokens - 1) // kv.block_size]
        return self.claim(hashes[num_hit // kv.block_size:], request.request_id if from_disk else None)

    def reload_for(self, kv: KVCacheManager, request: Request, keys: list[int], num_hit: int) -> None:
        """After the request's blocks are allocated: its claimed blocks come back from the tier."""
        first = num_hit // kv.block_size
        self.reload(keys, [ids[first:first + len(keys)] for ids in kv.get_block_ids(request.request_id)])
        self.forget(request.request_id)
