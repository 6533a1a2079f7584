"""The batch-invariant mode's attention (`--batch-invariant`, engine/quant/batch_invariant.py).

Every sequence attends over its whole context read back from the paged cache (a prefill's own new
keys too, as the cache holds them: an fp8 cache is read the same way by every path): the step's
decodes together (`fixed_split_decode`, their block tables padded to the longest), each prefill or
prefill chunk on its own (`fixed_split_attention`). A query's output is then the same whether it is
decoded, prefilled in one piece or in chunks, after a prefix-cache hit or a preemption's
recompute, beside any other sequences.

The fixed-split kernels have no attention sinks (gpt-oss's per-head logit in the softmax's
denominator): `takes_sinks` is False, and a model with sinks is refused in this mode."""
from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata, BaseAttentionBackend, gather_kv, write_kv
from engine.attention.torch_backend import _gather_rows, context_slots
from engine.quant.batch_invariant import fixed_split_attention, fixed_split_decode


class BatchInvariantAttentionBackend(BaseAttentionBackend):
    name = "batch_invariant"

    def __init__(self):
        self._decode: tuple[torch.Tensor, torch.Tensor] | None = None  # block ids (padded tables), lengths
        self._prefills: list[tuple[int, int, torch.Tensor]] = []  # per prefill: first token, query length, slots

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        self._decode = None
        if nd:
            max_blocks = -(-max(meta.seq_lens_cpu[:nd]) // meta.block_size)
            self._decode = meta.block_tables[:nd, :max_blocks].reshape(-1).long(), meta.seq_lens[:nd].long()
        starts = meta.query_start_loc.tolist()
        self._prefills = [(starts[i], meta.query_lens[i],
                           context_slots(meta.block_tables[i:i + 1], meta.seq_lens_cpu[i], meta.block_size)[0])
                          for i in range(nd, meta.num_seqs)]

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        self.refuse_sinks(sinks)  # takes_sinks is False: create_attention_backend refuses a model with sinks
        write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        out = torch.empty_like(q)
        if self._decode is not None:
            ids, lengths = self._decode
            nd = lengths.shape[0]
            keys, values = (t.view(nd, -1, num_kv_heads, head_dim)
                            for t in _gather_rows(kv_cache, ids, nd, q.dtype, k_scale, v_scale))
            out[:nd] = fixed_split_decode(q[:nd], keys, values, lengths, scale, window, softcap)
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        for start, q_len, slots in self._prefills:
            keys = gather_kv(flat[0], slots, q.dtype, k_scale)
            values = gather_kv(flat[1], slots, q.dtype, v_scale)
            out[start:start + q_len] = fixed_split_attention(q[start:start + q_len], keys, values, scale, window,
                                                             softcap)
        return out
