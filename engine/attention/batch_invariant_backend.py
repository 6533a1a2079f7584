"""The batch-invariant mode's attention (`--batch-invariant`, engine/batch_invariant.py).

Every sequence of a step, decode or prefill chunk, attends on its own: its whole context read back
from the paged cache (so a prefill's own new keys too, as the cache holds them: an fp8 cache is
read the same way by every path), then `fixed_split_attention`. A query's output is then the same
whether it is decoded, prefilled in one piece or in chunks, after a prefix-cache hit or a
preemption's recompute, beside any other sequences. One Python call per sequence and layer: the
mode trades speed for that (BENCHMARKS.md)."""
from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata, BaseAttentionBackend, gather_kv, write_kv
from engine.attention.torch_backend import context_slots
from engine.batch_invariant import fixed_split_attention


class BatchInvariantAttentionBackend(BaseAttentionBackend):
    name = "batch_invariant"

    def __init__(self):
        self._plans: list[tuple[int, int, torch.Tensor]] = []  # per sequence: first token, query length, slots

    def prepare(self, meta: AttentionMetadata) -> None:
        starts = meta.query_start_loc.tolist()
        self._plans = [(starts[i], meta.query_lens[i],
                        context_slots(meta.block_tables[i:i + 1], meta.seq_lens_cpu[i], meta.block_size)[0])
                       for i in range(meta.num_seqs)]

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None):
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        out = torch.empty_like(q)
        for start, q_len, slots in self._plans:
            keys = gather_kv(flat[0], slots, q.dtype, k_scale)
            values = gather_kv(flat[1], slots, q.dtype, v_scale)
            out[start:start + q_len] = fixed_split_attention(q[start:start + q_len], keys, values, scale, window,
                                                             softcap)
        return out
