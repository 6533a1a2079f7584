"""Paged KV blocks with prefix caching: `BlockPool` owns the `Block`s (0 is the null block),
the LRU free queue and the hash -> block map; `KVCacheManager` owns per-request block tables.
Chained block hashes are stable across processes and machines (cluster-wide prefix index)."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.core.kv_events import KVEventLog
from engine.core.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one block: stable across processes, seeds and machines.

    Args:
        parent_hash: the previous block's hash, None for the first block.
        token_ids: the block's token ids.

    Returns:
        A 64-bit unsigned int: blake2b over the little-endian parent hash and int64 tokens.
    """
    parent = b"\x00" if parent_hash is None else b"\x01" + struct.pack("<Q", parent_hash)
    data = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def salt_root(cache_salt: str | None) -> int | None:
    """A salted request's first block's parent hash (SamplingParams.cache_salt; None: no salt)."""
    if cache_salt is None:
        return None
    data = b"pdserve cache_salt\x00" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of `token_ids` (a salted prompt's from its salt's root)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(hash_block_tokens(out[-1] if out else salt_root(cache_salt), token_ids[start:start + block_size]))
    return out


@dataclass(eq=False)
class Block:
    """One physical KV block. Identity (not value) equality: blocks are unique."""
    block_id: int
    ref_cnt: int = 0
    block_hash: int | tuple | None = None  # its prefix-cache key, set while the block is in the hash map


class BlockPool:
    """Owns the Blocks, the LRU free queue and the prefix-cache hash map. The free queue
    (OrderedDict: O(1) append, popleft, remove) holds exactly the non-null blocks with
    ref_cnt == 0, head evicted first."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self._free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._is_free = bytearray([0] + [1] * (num_blocks - 1))  # 1 where the block is in the free queue
        self._cached: dict[int, Block] = {}
        self.events = KVEventLog(capacity=max(1024, 2 * num_blocks))  # what the cache stores and evicts
        self.on_evict: Callable[[Block], bool] | None = None  # a host tier's: True when it keeps the block's KV
        self.on_store: Callable[[Block], None] | None = None  # a write-through tier's: told of each block cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int, contiguous: bool = False) -> list[Block]:
        """Take free blocks, evicting their cached hashes.

        Args:
            num_blocks: how many blocks to take.
            contiguous: take the fewest stretches of consecutive block ids (the smallest free
                stretch that holds them all, else the longest ones), wherever they are in the
                eviction order: a KV transfer receives each stretch straight into the cache.
                Otherwise the head of the free queue (least recently used first).

        Returns:
            The blocks, each with ref_cnt == 1 and no hash, in block id order (blocks freed
            together, a request's, come back as consecutive ids).
        """
        if num_blocks < 0 or num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.num_free_blocks} free")
        if contiguous and num_blocks > 1:
            blocks = [self._free_queue.pop(i) for i in self._fewest_runs(num_blocks)]
        else:
            blocks = sorted((self._free_queue.popitem(last=False)[1] for _ in range(num_blocks)),
                            key=lambda b: b.block_id)
        for block in blocks:
            self._is_free[block.block_id] = 0
            assert block.ref_cnt == 0 and block is not self.null_block
            if block.block_hash is not None:  # evict it from the prefix cache
                evicted = self._cached.pop(block.block_hash)
                assert evicted is block
                if self.on_evict is None or not self.on_evict(block):  # else it is held in a tier still
                    self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def _fewest_runs(self, num_blocks: int) -> list[int]:
        """Ids of `num_blocks` free blocks in as few stretches of consecutive ids as possible."""
        free = torch.frombuffer(self._is_free, dtype=torch.int8)
        edges = torch.diff(free, prepend=free.new_zeros(1), append=free.new_zeros(1))
        starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
        lengths = ends - starts
        longest = int(lengths.max())
        if longest >= num_blocks:  # best fit: the smallest stretch that holds them (the lowest, on ties)
            start = int(starts[torch.where(lengths >= num_blocks, lengths, longest + 1).argmin()])
            return list(range(start, start + num_blocks))
        ids: list[int] = []  # the longest stretches: at most num_blocks of them are needed
        for j in lengths.topk(min(num_blocks, lengths.numel())).indices.tolist():
            take = min(num_blocks - len(ids), int(lengths[j]))
            ids += range(int(starts[j]), int(starts[j]) + take)
            if len(ids) == num_blocks:
                return sorted(ids)
        raise AssertionError("fewer free blocks than counted")

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block; unreferenced ones leave the free queue.

        Args:
            blocks: blocks to share (prefix-cache hits).
        """
        for block in blocks:
            assert block is not self.null_block
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
                self._is_free[block.block_id] = 0
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference from each block, in order; those reaching 0 join the tail.

        Args:
            blocks: blocks to release, in the order they should become evictable.
        """
        for block in blocks:
            assert block is not self.null_block and block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                self._is_free[block.block_id] = 1

    def cache_block(self, block: Block, block_hash: int) -> bool:
        """Register a full block under its hash; an existing mapping is kept, not duplicated.

        Args:
            block: a referenced, full block.
            block_hash: its chained hash.

        Returns:
            True if the map now points `block_hash` at `block`.
        """
        assert block.ref_cnt > 0 and block is not self.null_block
        if block.block_hash is not None:
            assert block.block_hash == block_hash, "a block's content cannot change while referenced"
            return True
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.events.stored(block_hash)
        if self.on_store is not None:
            self.on_store(block)
        return True

    def get_cached_block(self, block_hash: int) -> Block | None:
        """Returns the block cached under `block_hash`, or None (a miss)."""
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash.

        Returns:
            True, or False (nothing changed) if some block is still referenced.
        """
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.events.cleared()
        return True


def first_read_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block a query at position `num_tokens` reads: the blocks before it lie wholly
    outside its `window` (the keys it sees, its own included). 0 without a window."""
    return 0 if window is None else max(0, num_tokens - window + 1) // block_size


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, one table per KV group (`windows`: each
    group's window, ModelConfig.kv_layout; one full-attention group by default). Every request
    passed to `get_computed_blocks` or `allocate_slots` must end with `free(request)`.

    In a sliding group, blocks wholly before the keys a request's next query can see are released
    (`drop_out_of_window`): their table entries become the null block, and they join the free
    queue, hashes kept, so the prefix cache can still hit them until evicted. A table may so start
    with null entries, which are never cached nor freed. The groups share the pool; a block's
    prefix-cache key is its chained hash in group 0, (group, hash) in the others."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.windows = tuple(windows)
        self.num_window_freed = 0  # blocks released by drop_out_of_window, cumulative
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[list[Block]]] = {}  # per request, a table per group
        # Per request: hashes of its full known blocks; how many table blocks went to the map.
        self.req_to_block_hashes: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.tier = None  # a HostTier (engine/core/host_tier.py; attach_tier sets it): evicted blocks' KV in host memory

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)

    @staticmethod
    def _key(group: int, block_hash: int):
        return block_hash if group == 0 else (group, block_hash)

    def _update_block_hashes(self, request: Request) -> list[int]:
        """Extend the request's hash list to all its full blocks; returns it."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            token_ids = request.all_token_ids
            parent = hashes[-1] if hashes else salt_root(request.sampling_params.cache_salt)
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[Block], ...], int]:
        """Longest cached prefix of the request's full blocks that every group can read: a
        full-attention group needs each of its blocks, a sliding group only those its window
        reaches from the first uncomputed token (the rest are null entries). No ref-count change.

        Args:
            request: a request without a block table yet.

        Returns:
            (blocks per group, num_computed_tokens), at most `(num_tokens - 1) // block_size` blocks
            so the model still computes the last token (for logits); nothing with caching off.
        """
        if not self.enable_prefix_caching:
            return tuple([] for _ in self.windows), 0
        hashes = self._update_block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        found = [[self.block_pool.get_cached_block(self._key(g, h)) for h in hashes] for g in range(len(self.windows))]
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                n = next((i for i, b in enumerate(found[g][:n]) if b is None), n)
        while n and not all(None not in found[g][first_read_block(n * self.block_size, w, self.block_size):n]
                            for g, w in enumerate(self.windows) if w is not None):
            n -= 1
        null = self.block_pool.null_block
        tables = []
        for g, window in enumerate(self.windows):
            first = min(first_read_block(n * self.block_size, window, self.block_size), n)
            tables.append([null] * first + found[g][first:n])
        return tuple(tables), n * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[list[Block]] | None = None,
                       num_tokens_to_cache: int | None = None, contiguous: bool = False,
                       num_null_blocks: Sequence[int] | None = None) -> tuple[list[Block], ...] | None:
        """Grow the request's block tables to hold its computed and new tokens.

        Args:
            request: the request; `num_computed_tokens` is what its tables already hold.
            num_new_tokens: tokens to be computed this step (>= 0).
            new_computed_blocks: hits from `get_computed_blocks`, per group; first call only.
            num_tokens_to_cache: how many leading tokens will hold valid KV after this step
                (default: all of them). Blocks beyond stay out of the prefix cache until
                `cache_blocks` says their KV is there (allocation ahead of compute or transfer).
            contiguous: new blocks in the fewest stretches of consecutive ids, ahead of the
                eviction order (`BlockPool.get_new_blocks`): for KV that arrives by transfer.
            num_null_blocks: per group, a new table starts with this many null entries (blocks a
                sliding window never reads: a transfer ships only the rest); no hits with them.

        Returns:
            The new blocks per group (maybe empty), or None if too few are free (nothing changed).
        """
        # |<- num_computed_tokens ->|<- len(hits) * block_size ->|<- num_new_tokens ->|
        # | table before this call  | hits (touched, shared)     | new_blocks         |
        # |<--------------------------- num_tokens_needed --------------------------->|
        # Full blocks within min(num_tokens_needed, request.num_tokens) are hashed and cached.
        num_groups, req_id = len(self.windows), request.request_id
        hits = list(new_computed_blocks or [[]] * num_groups)
        nulls = list(num_null_blocks or [0] * num_groups)
        self._check_allocate_args(request, num_new_tokens, hits)
        assert not (any(nulls) and (any(hits) or req_id in self.req_to_blocks)), "null blocks start a new table"
        tables = self.req_to_blocks.get(req_id) or [[] for _ in range(num_groups)]
        num_tokens_needed = request.num_computed_tokens + len(hits[0]) * self.block_size + num_new_tokens
        num_new = [max(0, -(-num_tokens_needed // self.block_size) - len(t) - len(h) - k)
                   for t, h, k in zip(tables, hits, nulls)]
        # Touching an unreferenced hit takes it out of the free queue.
        null = self.block_pool.null_block
        shared = [b for h in hits for b in h if b is not null]
        if sum(num_new) > self._num_free_beside(shared) and not (
                self.tier is not None and self.tier.drop_uncopied() and sum(num_new) <= self._num_free_beside(shared)):
            return None
        self.block_pool.touch(shared)
        new_blocks = tuple(self.block_pool.get_new_blocks(n, contiguous) for n in num_new)
        for table, k, h, new in zip(tables, nulls, hits, new_blocks):
            table.extend([null] * k + h + new)
        self.req_to_blocks[req_id] = tables
        self.num_cached_block.setdefault(req_id, len(hits[0]))
        self._cache_full_blocks(request, num_tokens_needed if num_tokens_to_cache is None else num_tokens_to_cache)
        return new_blocks

    def _num_free_beside(self, shared: list[Block]) -> int:
        """Free blocks left once the unreferenced ones of `shared` (hits) are touched."""
        return self.block_pool.num_free_blocks - sum(b.ref_cnt == 0 for b in shared)

    def cache_blocks(self, request: Request, num_tokens: int, valid_from: Sequence[int] = ()) -> None:
        """The first `num_tokens` tokens of the request now hold valid KV: offer their full
        blocks to the prefix cache (after `allocate_slots(..., num_tokens_to_cache=...)`).
        `valid_from`, per group: the first token whose KV is there (a transfer cut to a sliding
        window): a block holding any token before it stays out of the cache for good."""
        self._cache_full_blocks(request, num_tokens, valid_from)

    def _check_allocate_args(self, request: Request, num_new_tokens: int, hits: list[list[Block]]) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if len(hits) != len(self.windows) or len({len(h) for h in hits}) > 1:
            raise ValueError(f"computed blocks come as one list of equal length per group ({len(self.windows)})")
        if hits[0] and (request.request_id in self.req_to_blocks or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id}: computed blocks only start a new table")
        assert all(self.block_pool.get_cached_block(b.block_hash) is b
                   for h in hits for b in h if b is not self.block_pool.null_block), "hit evicted"

    def _cache_full_blocks(self, request: Request, num_tokens: int, valid_from: Sequence[int] = ()) -> None:
        """Offer to the hash map the tables' full blocks within the first `num_tokens` (per group,
        none that holds a token before its `valid_from`)."""
        req_id, tables = request.request_id, self.req_to_blocks[request.request_id]
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_done = self.num_cached_block[req_id]
        if not self.enable_prefix_caching or num_full <= num_done:
            return
        hashes = self._update_block_hashes(request)
        assert len(hashes) >= num_full and all(len(t) >= num_full for t in tables)
        for g, blocks in enumerate(tables):
            first = -(-valid_from[g] // self.block_size) if valid_from else 0  # the first block wholly valid
            for i in range(max(num_done, first), num_full):
                if blocks[i] is not self.block_pool.null_block:  # never received: nothing to cache
                    self.block_pool.cache_block(blocks[i], self._key(g, hashes[i]))
        self.num_cached_block[req_id] = num_full

    def drop_out_of_window(self, request: Request) -> tuple[int, ...]:
        """Release the request's blocks that lie wholly before the keys its next query (position
        `num_computed_tokens`) sees, in each sliding group. Returns, per group, how many leading
        table entries are now null (released here or before); zeros without a window."""
        tables = self.req_to_blocks.get(request.request_id)
        if not tables or all(w is None for w in self.windows):
            return (0,) * len(self.windows)
        null, out = self.block_pool.null_block, []
        for blocks, window in zip(tables, self.windows):
            num_out = min(first_read_block(request.num_computed_tokens, window, self.block_size), len(blocks))
            dropped = [b for b in blocks[:num_out] if b is not null]
            if dropped:
                blocks[:num_out] = [null] * num_out
                self.block_pool.free_blocks(dropped)
                self.num_window_freed += len(dropped)
            out.append(num_out)
        return tuple(out)

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first and forget its state.

        Args:
            request: the request (a no-op if the manager holds nothing for it).
        """
        req_id = request.request_id
        for table in self.req_to_blocks.pop(req_id, []):
            self.block_pool.free_blocks(reversed([b for b in table if b is not self.block_pool.null_block]))
        self.req_to_block_hashes.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)

    def trim(self, request: Request, num_tokens: int) -> tuple[list[int], ...]:
        """Speculative decoding's rollback: frees the blocks past the first `num_tokens` tokens (slots
        taken for drafts that were rejected, or never proposed). Such blocks hold no token of the
        request's own, so none of them is in the prefix cache. Returns per group the freed block ids."""
        keep, null, freed = -(-num_tokens // self.block_size), self.block_pool.null_block, []
        for table in self.req_to_blocks.get(request.request_id, []):
            tail = table[keep:]
            del table[keep:]
            self.block_pool.free_blocks(reversed([b for b in tail if b is not null]))
            freed.append([b.block_id for b in tail])
        return tuple(freed)

    def fork(self, parent_id: str, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """`child` shares the KV of `parent_id`'s first `num_tokens` tokens (n > 1 choices of one prompt):
        their full blocks are referenced once more; a partial last block is copied into a new block of the
        child's (copy on write: each sequence writes its next token there).

        Returns:
            The copies the runner must make before the child's first step, (src, dst) block ids, or None
            (nothing changed) if too few blocks are free.
        """
        tables, bs, null = self.req_to_blocks[parent_id], self.block_size, self.block_pool.null_block
        num_blocks, partial = -(-num_tokens // bs), num_tokens % bs != 0
        assert all(len(t) == num_blocks for t in tables), "a parent holds exactly its tokens' blocks"
        num_copies = sum(partial and t[-1] is not null for t in tables)
        if num_copies > self.block_pool.num_free_blocks and not (  # a write-through tier's held blocks go first
                self.tier is not None and self.tier.drop_uncopied() and num_copies <= self.block_pool.num_free_blocks):
            return None
        copies, child_tables = [], []
        fresh = iter(self.block_pool.get_new_blocks(num_copies))
        for table in tables:
            shared = table[:-1] if partial and table[-1] is not null else list(table)
            self.block_pool.touch([b for b in shared if b is not null])
            if len(shared) < len(table):
                dst = next(fresh)
                copies.append((table[-1].block_id, dst.block_id))
                shared.append(dst)
            child_tables.append(shared)
        self.req_to_blocks[child.request_id] = child_tables
        self.req_to_block_hashes[child.request_id] = self.req_to_block_hashes.get(parent_id, [])[:num_tokens // bs]
        self.num_cached_block[child.request_id] = min(self.num_cached_block[parent_id], num_tokens // bs)
        return copies

    def rename(self, old_id: str, new_id: str) -> None:
        """The blocks of request `old_id` now belong to `new_id` (a parent's first choice takes them over)."""
        for state in (self.req_to_blocks, self.req_to_block_hashes, self.num_cached_block):
            if old_id in state:
                state[new_id] = state.pop(old_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables.

        Args:
            request_id: a request with block tables (KeyError otherwise).

        Returns:
            Per group, physical block ids in logical order.
        """
        return tuple([b.block_id for b in table] for table in self.req_to_blocks[request_id])

    def get_block_hashes(self, request_id: str) -> list[int]:
        """Hashes of the full blocks in the request's table (computed or being computed).

        Args:
            request_id: a request with a block table (KeyError otherwise).

        Returns:
            Chained hashes, head first, for the cluster prefix index; [] with caching off.
        """
        return self.req_to_block_hashes.get(request_id, [])[:self.num_cached_block[request_id]]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, a host tier's too; False (no change) if some block is in use."""
        if self.tier is not None:
            self.tier.drop_pending()  # its write-through copies hold their blocks
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.clear()
        return True

    def assert_no_leaks(self) -> None:
        """Raise AssertionError unless all requests are freed and all blocks free (but those a host
        tier holds for their write-through copies, engine/core/host_tier.py)."""
        left = self.req_to_blocks.keys() | self.req_to_block_hashes.keys() | self.num_cached_block.keys()
        tier_held = self.tier.held_block_ids if self.tier is not None else set()
        held = [b.block_id for b in self.block_pool.blocks if b.ref_cnt != (b.block_id in tier_held)]
        num_free, num_usable = self.num_free_blocks, self.block_pool.num_blocks - 1 - len(tier_held)
        if left or held or num_free != num_usable:
            raise AssertionError(f"leak: requests {sorted(left)}, held {held}, {num_free}/{num_usable} free")
