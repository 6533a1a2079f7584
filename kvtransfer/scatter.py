"""Where a request's reserved slots lie in the paged cache: stretches of consecutive slots (which
a payload can be received into directly), and writing one received layer of a part into them;
and reading or writing by token a cache laid out by its attention backend (its kv_views)."""
from __future__ import annotations

import torch


def scatter_layer(layer: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor | None, kv: torch.Tensor,
                  lo: int) -> None:
    """Writes kv (2, num_tokens, n_heads, head_dim) into heads [lo, lo + n_heads) of `slots` of one
    layer (2, num_blocks, block_size, local_kv_heads, head_dim); `block_ids` is
    `whole_blocks(slots, block_size)`.

    Fast path (a part with all of this rank's heads, the usual case): whole blocks are copied as
    rows of 4-byte words, 3-4x faster than per-token indexing of 2-byte elements."""
    _, num_blocks, block_size, num_heads, head_dim = layer.shape
    num_slots = num_blocks * block_size
    if lo != 0 or kv.shape[2] != num_heads:
        as_bytes(layer.view(2, num_slots, num_heads, head_dim))[:, slots, lo:lo + kv.shape[2]] = as_bytes(kv)
        return
    n_full = 0 if block_ids is None else block_ids.numel() * block_size
    if n_full:  # (2, blocks, block_size * heads * head_dim) as wide words
        dst, src = _words(layer.view(2, num_blocks, -1), kv[:, :n_full].reshape(2, block_ids.numel(), -1))
        dst.index_copy_(1, block_ids, src)
    if n_full < kv.shape[1]:  # the rest token by token: (2, slots, heads * head_dim)
        dst, rest = _words(layer.view(2, num_slots, -1), kv[:, n_full:].reshape(2, kv.shape[1] - n_full, -1))
        dst.index_copy_(1, slots[n_full:], rest)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first token, length, first slot) of each stretch of consecutive slots, in token order.

        slots [32..47, 48..63, 96..111]  ->  [(0, 32, 32), (32, 16, 96)]
    """
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, slots.numel()]
    return [(a, b - a, s) for a, b, s in zip(starts, ends, slots[starts].tolist())]


def whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if the leading full blocks' worth of slots are whole blocks in order, else None.

        slots  [b0*bs .. b0*bs+bs-1 | b1*bs .. b1*bs+bs-1 | ... | tail (< bs)]  ->  [b0, b1, ...]
    """
    n = slots.numel() // block_size
    if n == 0:
        return None
    head = slots[:n * block_size].view(n, block_size)
    starts = head[:, 0]
    if bool((starts % block_size == 0).all()) and torch.equal(head, starts[:, None] + torch.arange(
            block_size, device=slots.device)):
        return starts // block_size
    return None


def _words(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The same bytes as 4-byte words when every tensor's rows allow it (index_copy_ moves wide
    elements faster), else as they are (fp8 as bytes)."""
    def fits(t: torch.Tensor) -> bool:
        size = t.element_size()
        return size < 4 and all(n * size % 4 == 0 for n in (t.shape[-1], t.storage_offset(), *t.stride()[:-1]))
    if all(map(fits, ts)):
        return [t.view(torch.int32) for t in ts]
    return [as_bytes(t) for t in ts]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes): index_copy_, index_put_ and index_select need not
    have fp8 kernels (CPU's index_copy_ has none); any other tensor as it is."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def gather_tokens(views: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """(2, num_tokens, heads, head_dim): the K/V of `slots` read through a backend's token views
    (BaseAttentionBackend.kv_views), for caches not in the torch layout."""
    blocks, offsets = slots // block_size, slots % block_size
    return torch.stack([as_bytes(views[0])[blocks, offsets], as_bytes(views[1])[blocks, offsets]]).view(
        views[0].dtype)


def scatter_tokens(views: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, block_size: int,
                   kv: torch.Tensor, lo: int) -> None:
    """Writes kv (2, num_tokens, n_heads, head_dim) into heads [lo, lo + n_heads) of `slots` through
    a backend's token views (the inverse of gather_tokens)."""
    blocks, offsets = slots // block_size, slots % block_size
    for view, part in zip(views, kv):
        as_bytes(view)[blocks, offsets, lo:lo + kv.shape[2]] = as_bytes(part)
