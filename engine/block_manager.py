"""Paged KV blocks with prefix caching: `BlockPool` owns the `Block`s (0 is the null block),
the LRU free queue and the hash -> block map; `KVCacheManager` owns per-request block tables.
Chained block hashes are stable across processes and machines (cluster-wide prefix index)."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.request import Request


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


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of `token_ids`."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(hash_block_tokens(out[-1] if out else None, token_ids[start:start + block_size]))
    return out


@dataclass(eq=False)
class Block:
    """One physical KV block. Identity (not value) equality: blocks are unique."""
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is in the hash map


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
        return True


class KVCacheManager:
    """Per-request block tables on top of a BlockPool. Every request passed to
    `get_computed_blocks` or `allocate_slots` must end with `free(request)`.

    With a sliding window (`window`: every layer's, ModelConfig.kv_window), blocks wholly before
    the keys a request's next query can see are released (`drop_out_of_window`): their table
    entries become the null block, and they join the free queue, hashes kept, so the prefix
    cache can still hit them until evicted. A table may so start with null entries, which are
    never cached nor freed."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.enable_prefix_caching, self.window = block_size, enable_prefix_caching, window
        self.num_window_freed = 0  # blocks released by drop_out_of_window, cumulative
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Per request: hashes of its full known blocks; how many table blocks went to the map.
        self.req_to_block_hashes: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)

    def _update_block_hashes(self, request: Request) -> list[int]:
        """Extend the request's hash list to all its full blocks; returns it."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            token_ids = request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request's full blocks. No ref-count change.

        Args:
            request: a request without a block table yet.

        Returns:
            (blocks, num_computed_tokens), at most `(num_tokens - 1) // block_size` blocks so
            the model still computes the last token (for logits); ([], 0) with caching off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_blocks]:
            if (block := self.block_pool.get_cached_block(block_hash)) is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] | None = None,
                       num_tokens_to_cache: int | None = None, contiguous: bool = False,
                       num_null_blocks: int = 0) -> list[Block] | None:
        """Grow the request's block table to hold its computed and new tokens.

        Args:
            request: the request; `num_computed_tokens` is what its table already holds.
            num_new_tokens: tokens to be computed this step (>= 0).
            new_computed_blocks: hits from `get_computed_blocks`; first call only.
            num_tokens_to_cache: how many leading tokens will hold valid KV after this step
                (default: all of them). Blocks beyond stay out of the prefix cache until
                `cache_blocks` says their KV is there (allocation ahead of compute or transfer).
            contiguous: new blocks in the fewest stretches of consecutive ids, ahead of the
                eviction order (`BlockPool.get_new_blocks`): for KV that arrives by transfer.
            num_null_blocks: a new table starts with this many null entries (blocks a sliding
                window never reads: a transfer ships only the rest); no hits with it.

        Returns:
            The new blocks (maybe []), or None if too few are free (then nothing changed).
        """
        # |<- num_computed_tokens ->|<- len(hits) * block_size ->|<- num_new_tokens ->|
        # | table before this call  | hits (touched, shared)     | new_blocks         |
        # |<--------------------------- num_tokens_needed --------------------------->|
        # Full blocks within min(num_tokens_needed, request.num_tokens) are hashed and cached.
        hits = new_computed_blocks or []
        req_id = request.request_id
        self._check_allocate_args(request, num_new_tokens, hits)
        assert not (num_null_blocks and (hits or req_id in self.req_to_blocks)), "null blocks start a new table"
        blocks = self.req_to_blocks.get(req_id, ())
        num_tokens_needed = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens_needed // self.block_size) - len(blocks) - len(hits) - num_null_blocks)
        # Touching an unreferenced hit takes it out of the free queue.
        num_evictable_hits = sum(b.ref_cnt == 0 for b in hits)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks, contiguous)
        table = self.req_to_blocks.setdefault(req_id, [])
        table.extend([self.block_pool.null_block] * num_null_blocks + hits + new_blocks)
        self.num_cached_block.setdefault(req_id, len(hits))
        self._cache_full_blocks(request, num_tokens_needed if num_tokens_to_cache is None else num_tokens_to_cache)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """The first `num_tokens` tokens of the request now hold valid KV: offer their full
        blocks to the prefix cache (after `allocate_slots(..., num_tokens_to_cache=...)`)."""
        self._cache_full_blocks(request, num_tokens)

    def _check_allocate_args(self, request: Request, num_new_tokens: int, hits: list[Block]) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if hits and (request.request_id in self.req_to_blocks or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id}: computed blocks only start a new table")
        assert all(self.block_pool.get_cached_block(b.block_hash) is b for b in hits), "hit evicted"

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer to the hash map the table's full blocks within the first `num_tokens`."""
        req_id, blocks = request.request_id, self.req_to_blocks[request.request_id]
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_done = self.num_cached_block[req_id]
        if not self.enable_prefix_caching or num_full <= num_done:
            return
        hashes = self._update_block_hashes(request)
        assert len(hashes) >= num_full and len(blocks) >= num_full
        for i in range(num_done, num_full):
            if blocks[i] is not self.block_pool.null_block:  # never received: nothing to cache
                self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[req_id] = num_full

    def drop_out_of_window(self, request: Request) -> int:
        """Release the request's blocks that lie wholly before the keys its next query (position
        `num_computed_tokens`) sees; no-op without a window. Returns how many leading table
        entries are now null (released here or before)."""
        if self.window is None:
            return 0
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        null = self.block_pool.null_block
        num_out = min(max(0, request.num_computed_tokens - self.window + 1) // self.block_size, len(blocks))
        dropped = [b for b in blocks[:num_out] if b is not null]
        if dropped:
            blocks[:num_out] = [null] * num_out
            self.block_pool.free_blocks(dropped)
            self.num_window_freed += len(dropped)
        return num_out

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first and forget its state.

        Args:
            request: the request (a no-op if the manager holds nothing for it).
        """
        req_id = request.request_id
        held = [b for b in self.req_to_blocks.pop(req_id, []) if b is not self.block_pool.null_block]
        self.block_pool.free_blocks(reversed(held))
        self.req_to_block_hashes.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table.

        Args:
            request_id: a request with a block table (KeyError otherwise).

        Returns:
            Physical block ids in logical order.
        """
        return [b.block_id for b in self.req_to_blocks[request_id]]

    def get_block_hashes(self, request_id: str) -> list[int]:
        """Hashes of the full blocks in the request's table (computed or being computed).

        Args:
            request_id: a request with a block table (KeyError otherwise).

        Returns:
            Chained hashes, head first, for the cluster prefix index; [] with caching off.
        """
        return self.req_to_block_hashes.get(request_id, [])[:self.num_cached_block[request_id]]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (no change) if some block is in use."""
        return self.block_pool.reset_prefix_cache()

    def assert_no_leaks(self) -> None:
        """Raise AssertionError unless all requests are freed and all blocks free."""
        left = self.req_to_blocks.keys() | self.req_to_block_hashes.keys() | self.num_cached_block.keys()
        held = [b.block_id for b in self.block_pool.blocks if b.ref_cnt != 0]
        num_free, num_usable = self.num_free_blocks, self.block_pool.num_blocks - 1
        if left or held or num_free != num_usable:
            raise AssertionError(f"leak: requests {sorted(left)}, held {held}, {num_free}/{num_usable} free")
