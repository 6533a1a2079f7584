"""Proposers whose drafter is a head over the target's hidden states: EAGLE-3 (eagle3.py) and
DeepSeek-V3's multi-token-prediction module (mtp.py).

The head runs on TP rank 0 beside the target (`HeadModel`, loaded before the target sizes its KV
pool, which counts the head's share of each block). After each target forward on rank 0 it keeps
every computed token's row (the hidden states it reads; `observe`). Feeding position p runs the
head on (the row of p, the token at p + 1) at p. A `propose` first feeds the positions whose rows
it has not fed (after a verify step: the kept drafts'), at most CATCH_UP_TOKENS per step, then
drafts: the output at the last fed position gives the first draft, and each draft, with the
head's own pre-norm output in place of a target row, the next.

The head's KV sits in blocks of its own pool, a table per sequence, from the first position it
has a row for (slot 0 of its table; rotary positions stay the sequence's). A remote prefill's
prompt rows come with its KV (rows.py on the prefill instance, `receive_rows` here); tokens
that neither instance computed (a prefix-cache hit) are outside its context.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.speculative.base import PROFILE_CONTEXT, Proposer, SpecSequence
from engine.speculative.rows import rows_by_request

if TYPE_CHECKING:
    from engine.core.config import ModelConfig
    from engine.core.speculative_config import SpeculativeConfig
    from engine.parallel.step import ModelInput
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)

CATCH_UP_TOKENS = 256  # positions fed per sequence per step (a long prompt's rows over several steps)


@dataclass
class _HeadSeq:
    base: int  # the first position with a target row: the head's local position 0
    fed: int  # positions base .. fed - 1 are in the head's KV, fed from the target's rows
    # the target's rows from position `fed` on, not fed yet, a chunk per target step (joined when
    # fed: a sequence that does not speculate for a while gains a row a step, never a copy of them all)
    chunks: list[torch.Tensor]
    blocks: list[int] = field(default_factory=list)  # its table in the head's pool

    @property
    def rows_end(self) -> int:
        """The position after its last row."""
        return self.fed + sum(len(c) for c in self.chunks)

    def rows(self, end: int) -> torch.Tensor:
        """Its rows of positions fed .. end - 1, which it then no longer holds."""
        rows = torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [rows[end - self.fed:]]
        return rows[:end - self.fed]

    def truncate(self, end: int) -> None:
        """Drops its rows of positions end and after (a verify step's past its kept drafts)."""
        kept, n = [], end - self.fed
        for c in self.chunks:
            if n <= 0:
                break
            kept.append(c[:n])
            n -= len(c)
        self.chunks = kept


@dataclass
class _Feed:
    """One sequence's tokens in one head forward."""
    index: int  # of the sequence in `propose`
    token_ids: list[int]
    hidden: torch.Tensor  # a row per token
    first: int  # the first token's position
    base: int  # the sequence's first position in the head's KV (its slot 0)


class HeadModel:
    """A head module, its KV pool and its taps on the target (what `observe` keeps per token)."""

    reads_target_hidden = True

    def __init__(self, module: nn.Module, config: ModelConfig, target: TargetRunner,
                 taps: Callable[[torch.Tensor], torch.Tensor]):
        from engine.attention import create_attention_backend
        self.module, self.config, self.target, self.taps = module, config, target, taps
        tc = target.config
        self.backend = create_attention_backend(tc.attention_backend, target.device, target.dtype, target.kv_dtype,
                                                config.head_dim, mla=config.mla is not None)
        self.block_size = self.backend.block_size_for(tc.cache.block_size)
        if self.block_size != target.block_size:
            raise ValueError(f"the {config.name} head's attention backend takes {self.block_size}-token blocks, "
                             f"the target's {target.block_size}")
        self.num_kv_heads = module.attention.num_kv_heads
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks, self.free = 0, []
        self.seqs: dict[str, _HeadSeq] = {}
        self.rows_received = 0  # prompt rows shipped by prefill instances, since start
        self.observing = False  # from the proposer's start: the target's load-time profile steps are not kept

    def block_bytes(self) -> int:
        from engine.core.kv_cache import kv_block_bytes
        return kv_block_bytes(self.config, self.num_kv_heads, self.block_size, self.target.kv_dtype)

    def give_pool(self, num_blocks: int) -> None:
        from engine.core.kv_cache import allocate_kv_cache
        self.kv_cache = allocate_kv_cache(self.config, self.num_kv_heads, num_blocks, self.block_size,
                                          self.target.kv_dtype, self.target.device)
        self.num_blocks, self.free = num_blocks, list(range(num_blocks - 1, 0, -1))  # block 0: the null block
        logger.info("speculative decoding: head %s, %d KV blocks of %d tokens beside the target's (%.3f GiB)",
                    self.config.name, num_blocks, self.block_size, num_blocks * self.block_bytes() / 2**30)

    def observe(self, inp: ModelInput, hidden: torch.Tensor) -> None:
        rows = self.taps(hidden)
        if not self.observing:
            return
        for rid, start, own in rows_by_request(inp, rows):
            self._keep(rid, start, own)

    def _keep(self, rid: str, start: int, rows: torch.Tensor) -> None:
        s = self.seqs.get(rid)
        if s is None or not s.fed <= start <= s.rows_end:  # new here (or computed afresh)
            self.forget(rid)
            self.seqs[rid] = _HeadSeq(start, start, [rows.clone()])
            return
        s.truncate(start)
        s.chunks.append(rows.clone())  # its own copy: a slice would keep the whole step's rows alive

    def forget(self, rid: str) -> None:
        s = self.seqs.pop(rid, None)
        if s is not None:
            self.free += s.blocks

    def receive_rows(self, rid: str, start: int, rows: torch.Tensor, block_ids=None, token_ids=None) -> None:
        """A remote prefill's rows of the prompt's positions start .. (rows.RowRecorder, shipped with the
        KV): the head's context then begins there, as if it had computed them."""
        self.forget(rid)
        self.seqs[rid] = _HeadSeq(start, start, [rows.to(self.target.device, self.target.dtype)])
        self.rows_received += len(rows)

    def reserve(self, s: _HeadSeq, last: int) -> bool:
        """Blocks for the sequence's local positions up to `last`; False when the pool has too few."""
        need = last // self.block_size + 1 - len(s.blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            s.blocks.append(self.free.pop())
        return True

    @torch.inference_mode()
    def forward(self, feeds: list[_Feed], seqs: list[_HeadSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over `feeds` (each with its sequence's state); the normed and pre-norm
        outputs at each feed's last token, in order."""
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i].token_ids) != 1)  # decodes first
        bs, ids, positions, slots, qlens, slens, tables, last = self.block_size, [], [], [], [], [], [], []
        for i in order:
            f, blocks = feeds[i], seqs[i].blocks
            ids += f.token_ids
            n, local = len(f.token_ids), f.first - f.base
            positions += range(f.first, f.first + n)
            slots += [blocks[p // bs] * bs + p % bs for p in range(local, local + n)]
            qlens.append(n)
            slens.append(local + n)
            tables.append(blocks)
            last.append(len(ids) - 1)
        inp = self.target.model_input(ids, positions, [slots], qlens, slens, [tables], [], [])
        self.backend.prepare(inp.meta)
        hidden = torch.cat([feeds[i].hidden for i in order]).to(self.target.dtype)
        normed, prenorm = self.module(inp.input_ids, inp.positions, hidden, self.kv_cache, inp.meta, self.backend)
        back = torch.tensor(sorted(range(len(order)), key=lambda j: order[j]), device=normed.device)
        rows = torch.tensor(last, device=normed.device)[back]
        return normed[rows], prenorm[rows]


class HeadProposer(Proposer):
    """Drafts from a `HeadModel` (the target's rank-0 runner holds it as `draft`)."""

    def __init__(self, head: HeadModel):
        self.head = head
        head.observing = True

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetRunner | None) -> HeadProposer:
        assert isinstance(target.draft, HeadModel), "the target's rank-0 runner loads the head (load_model)"
        return cls(target.draft)

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        feeds, states = [], []
        for i, sq in enumerate(seqs):
            feed = self._catch_up(i, sq)
            if feed is not None:
                feeds.append(feed)
                states.append(self.head.seqs[sq.request_id])
        done = {f.index for f, s in zip(feeds, states) if s.fed == len(seqs[f.index].token_ids) - 1}
        step = 0
        while feeds:
            normed, prenorm = self.head.forward(feeds, states)
            tokens = self.head.module.draft_tokens(normed).tolist()
            feeds, states, step = self._next(feeds, states, tokens, prenorm, seqs, drafts, done, step)
        return drafts

    def _next(self, feeds, states, tokens, prenorm, seqs, drafts, done, step):
        """The feeds of the next draft step: each sequence that got a draft this step and wants more."""
        nxt, nstates = [], []
        for j, (f, s) in enumerate(zip(feeds, states)):
            if step == 0 and f.index not in done:  # a chunk of a long catch-up: no drafts yet
                continue
            drafts[f.index].append(tokens[j])
            if len(drafts[f.index]) < seqs[f.index].k:
                first = f.first + len(f.token_ids)
                nxt.append(_Feed(f.index, [tokens[j]], prenorm[j:j + 1], first, f.base))
                nstates.append(s)
        return nxt, nstates, step + 1

    def _catch_up(self, i: int, sq: SpecSequence) -> _Feed | None:
        """The positions the head has rows for and has not fed, up to the one before the last
        token (at most CATCH_UP_TOKENS of them); None when there are none, or no room for its drafts."""
        s = self.head.seqs.get(sq.request_id)
        n = len(sq.token_ids)
        if s is None or s.fed >= n - 1 or s.rows_end < n - 1:
            return None
        end = min(n - 1, s.fed + CATCH_UP_TOKENS)
        if not self.head.reserve(s, end - 1 - s.base + sq.k):
            logger.debug("speculative decoding: the head's KV pool is full; %s proposes nothing", sq.request_id)
            return None
        start = s.fed
        feed = _Feed(i, list(sq.token_ids[start + 1:end + 1]), s.rows(end), start, s.base)
        s.fed = end
        return feed

    def forget(self, request_id: str) -> None:
        self.head.forget(request_id)

    @property
    def rows_received(self) -> int:
        return self.head.rows_received

    def profile_seconds(self, batch_sizes: Sequence[int], k: int, device: torch.device) -> tuple[float, ...]:
        """k head decode steps per batch size, over PROFILE_CONTEXT positions of a scratch sequence each."""
        from engine.core.timing import best_seconds
        return tuple(k * best_seconds(lambda: self._profile_step(b, PROFILE_CONTEXT), device) for b in batch_sizes)

    def _profile_step(self, num_seqs: int, context: int) -> None:
        head, pool = self.head, self.head.kv_cache
        n = -(-context // head.block_size)
        head.kv_cache = torch.zeros_like(pool[:, :, :2])  # the null block and one block every entry points at
        hidden = torch.zeros(1, head.config.hidden_size, device=head.target.device, dtype=head.target.dtype)
        try:
            states = [_HeadSeq(0, 0, [hidden], [1] * n) for _ in range(num_seqs)]
            head.forward([_Feed(i, [0], hidden, context - 1, 0) for i in range(num_seqs)], states)
        finally:
            head.kv_cache = pool
