"""The batch-invariant mode (`--batch-invariant`): a token's numbers do not depend on its batch.

A server's default kernels make a request's logits depend on what runs beside it: a matmul of M
rows takes another code path for M = 1 than for M = 16 (BLAS's gemv against its gemm; oneDNN a
kernel JIT-built per shape), decode attention pads each sequence to the batch's longest context,
a prefill chunk's attention reduces over the chunk's keys, and a tensor-parallel layer sums its
ranks' partial products in another order than one rank does. Greedy decoding turns one rounding
difference into another text. In this mode every operation runs one fixed-shape kernel, so that
each row's result is a function of that row alone (vLLM's batch-invariant mode and SGLang's
deterministic inference do the same on GPUs, with their own kernels):

- linear layers (`BatchInvariantLinearMethod`): the rows cut into tiles of TILE_ROWS (padded with
  zero rows), every tile one (TILE_ROWS, in) x (in, out) product of one batched matmul; weights
  unquantized. A row-parallel layer (o_proj, down_proj) gathers its input from the ranks and
  multiplies by its whole weight on every rank (`replicates_row_parallel`), so that its sum runs
  in one rank's order whatever the TP size: no all-reduce of partial sums.
- attention (engine/attention/batch_invariant_backend.py): keys in fixed splits of SPLIT_KEYS
  counted from position 0, queries in tiles of TILE_ROWS, each split's scores and weighted values a
  fixed-shape matmul, the splits summed one after another in position order.
- RMSNorm, the elementwise ops, the softmax and log-softmax of sampling already reduce each row on
  its own (tests/engine/quant/test_batch_invariant.py checks them beside the above).

What it costs is measured in BENCHMARKS.md; docs/engine.md says what it guarantees.
"""
from __future__ import annotations

import torch

from engine.quant.base import UnquantizedLinearMethod

TILE_ROWS = 8  # rows (tokens, queries) per fixed-shape matmul; SmolLM2 decodes ran faster than with 4 or 16
SPLIT_KEYS = 32  # keys per attention split
MAX_TILE_SPLITS = 2048  # (query tile, key split) pairs attended at once: bounds a long prefill's memory


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x (rows, ...) with zero rows appended up to a multiple of `multiple`."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) with every row computed in a (TILE_ROWS, in) x (in, out) product.

    x: (..., in); weight: (out, in); `packed`: the weight in oneDNN's blocked layout (a CPU where
    it is available: one oneDNN kernel for that shape, run tile by tile), else one batched matmul
    over the tiles. Zero rows pad the last tile; their outputs are dropped."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    tiles = pad_rows(x2, TILE_ROWS).view(-1, TILE_ROWS, x2.shape[1])
    if packed is not None:
        out = torch.cat([torch.ops.mkldnn._linear_pointwise(tile, packed, None, "none", [], "") for tile in tiles])
    else:
        wt = weight.t()
        out = torch.bmm(tiles, wt.expand(tiles.shape[0], *wt.shape)).view(-1, weight.shape[0])
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """The checkpoint's weights in the model dtype, never quantized, multiplied by `tiled_linear`
    (prepacked for oneDNN where the unquantized method would pack them: a (TILE_ROWS, in) oneDNN
    product ran SmolLM2's decode faster than the batched matmul). A row-parallel layer holds its
    whole weight on every rank and gathers its input (engine/parallel/layers.py reads
    `replicates_row_parallel`)."""

    name = "batch_invariant"
    replicates_row_parallel = True  # engine/parallel/layers.py: RowParallelLinear

    def apply(self, layer, x, bias) -> torch.Tensor:
        return tiled_linear(x, layer.weight, bias, getattr(layer, "packed", None))

    def describe(self, layers) -> str:
        kernel = "oneDNN prepacked" if layers and getattr(layers[0], "packed", None) is not None else "batched matmul"
        return f"batch-invariant {TILE_ROWS}-row tiles ({kernel}, unquantized weights)"


def fixed_split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's newest queries over its whole context, batch-invariant.

    q: (q_len, heads, head_dim), the queries of positions L - q_len .. L - 1; k, v: (L, kv_heads,
    head_dim), positions 0 .. L - 1 (GQA: heads / kv_heads query heads per KV head). `window`: a
    query sees its own key and the window - 1 before it; `softcap`: scores become
    softcap * tanh(score / softcap). Returns (q_len, heads, head_dim) in q's dtype.

    Keys fall in splits of SPLIT_KEYS counted from position 0, queries in tiles of TILE_ROWS; each
    (tile, split) pair is one fixed-shape matmul for the scores and one for the weighted values, in
    float32; the softmax's maximum is exact, and the splits' sums are added one after another in
    position order. A split a query does not see adds exact zeros. So a query's result depends on
    its position and the keys it sees only: not on how many queries came with it, where in a tile
    it sits, or how far the context reaches past it. Long prefills run in groups of query tiles,
    each over the keys up to its last query (the same numbers, in bounded memory)."""
    q_len, length = q.shape[0], k.shape[0]
    step = max(1, MAX_TILE_SPLITS // -(-length // SPLIT_KEYS)) * TILE_ROWS
    lengths = torch.tensor([length], device=q.device)
    if q_len <= step:
        return _attend(q[None], k[None], v[None], lengths, scale, window, softcap)[0]
    first = length - q_len
    return torch.cat([_attend(q[None, a:a + step], k[None, :first + a + step], v[None, :first + a + step],
                              lengths.clamp(max=first + a + step), scale, window, softcap)[0]
                      for a in range(0, q_len, step)])


def fixed_split_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                       window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`fixed_split_attention` of many sequences' single newest queries at once, the same numbers.

    q: (B, heads, head_dim), sequence b's query at position lengths[b] - 1; k, v: (B, L, kv_heads,
    head_dim), sequence b's keys at 0 .. lengths[b] - 1, rows past them ignored (a shorter
    sequence's extra splits add exact zeros). Returns (B, heads, head_dim)."""
    past = torch.arange(k.shape[1], device=k.device)[None, :] >= lengths[:, None]  # (B, L)
    k, v = (t.masked_fill(past[:, :, None, None], 0) for t in (k, v))  # padding rows: finite, unseen
    return _attend(q[:, None], k, v, lengths, scale, window, softcap)[:, 0]


def _attend(q, k, v, lengths, scale, window, softcap) -> torch.Tensor:
    """q: (B, q_len, H, D) at positions lengths[b] - q_len ..; k, v: (B, L, Hkv, D) -> (B, q_len, H, D)."""
    batch, q_len, heads, head_dim = q.shape
    length, kv_heads = k.shape[1:3]
    qt = pad_rows(q.float().transpose(0, 1), TILE_ROWS).transpose(0, 1)  # (B, nq * T, H, D)
    num_tiles = qt.shape[1] // TILE_ROWS
    qt = qt.reshape(batch, num_tiles, TILE_ROWS, heads, head_dim).permute(0, 3, 1, 2, 4)  # (B, H, nq, T, D)
    num_splits = -(-length // SPLIT_KEYS)
    kt, vt = (pad_rows(t.float().transpose(0, 1), SPLIT_KEYS).transpose(0, 1)
              .reshape(batch, num_splits, SPLIT_KEYS, kv_heads, head_dim).permute(0, 3, 1, 2, 4)
              .repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # (B, H, ns, S, D)
    first = (lengths - q_len).view(batch, 1, 1, 1, 1, 1)
    q_pos = first + torch.arange(num_tiles * TILE_ROWS, device=q.device).view(1, 1, num_tiles, 1, TILE_ROWS, 1)
    k_pos = torch.arange(num_splits * SPLIT_KEYS, device=q.device).view(1, 1, 1, num_splits, 1, SPLIT_KEYS)
    seen = (k_pos <= q_pos) & (k_pos < lengths.view(batch, 1, 1, 1, 1, 1))  # (B, 1, nq, ns, T, S)
    if window is not None:
        seen &= k_pos > q_pos - window
    scores = torch.matmul(qt.unsqueeze(3), kt.unsqueeze(2).transpose(-1, -2)) * scale  # (B, H, nq, ns, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen, float("-inf"))
    top = scores.amax(dim=(3, 5), keepdim=True)  # every query sees its own key: finite
    weights = torch.exp(scores - top)
    sums = weights.sum(-1)  # (B, H, nq, ns, T)
    parts = torch.matmul(weights, vt.unsqueeze(2))  # (B, H, nq, ns, T, D)
    total, out = sums[:, :, :, 0], parts[:, :, :, 0]
    for s in range(1, num_splits):  # in position order, one split after another
        total = total + sums[:, :, :, s]
        out = out + parts[:, :, :, s]
    out = out / total.unsqueeze(-1)  # (B, H, nq, T, D)
    return out.permute(0, 2, 3, 1, 4).reshape(batch, -1, heads, head_dim)[:, :q_len].to(q.dtype)
