"""A prefill instance's side of speculative decoding: what the decode instances' proposer needs
of each prompt, computed on rank 0 and shipped with the prompt's KV as rows, a row per position
(PrefillConnector.finish; kvtransfer/wire.py `rows`), and what both ends agree is shipped.

- a head (heads.py): the target's rows the head reads (`RowRecorder`: the head's taps, no head);
- a draft model (draft_model.py): the draft's KV of the prompt (`DraftKVRecorder`: the draft runs
  its prompt pass beside the target, into its pool read through the target's block tables).

    runner.draft = row_recorder(spec, runner)   # registry.py; ModelRunner, for config.ship_proposer_rows
    start, rows = runner.draft.take(request_id, block_ids, num_tokens)   # after the prompt's last chunk
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.parallel.step import ModelInput


def rows_by_request(inp: ModelInput, rows: torch.Tensor) -> Iterator[tuple[str, int, torch.Tensor]]:
    """A step's rows (a row per token) per request: (its id, its first position, its rows)."""
    offset = 0
    for rid, start, n in inp.spans:
        yield rid, start, rows[offset:offset + n]
        offset += n


class RowRecorder:
    """A prefill instance's rank 0 (base.ProposerModel, with no pool): the rows of each prompt's
    computed tokens that the decode instances' head reads, shipped with the prompt's KV
    (PrefillConnector.finish) so the head's context holds the prompt there too."""

    reads_target_hidden = True
    num_blocks = 0

    def __init__(self, taps: Callable[[torch.Tensor], torch.Tensor]):
        self.taps = taps
        self.rows: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (first position, chunks)
        self.observing = False  # from the worker's start: the load-time profile's steps are not kept

    def block_bytes(self) -> int:
        return 0

    def give_pool(self, num_blocks: int) -> None:
        """It has no pool."""

    def observe(self, inp: ModelInput, hidden: torch.Tensor) -> None:
        rows = self.taps(hidden)
        if not self.observing:
            return
        for rid, start, own in rows_by_request(inp, rows):
            got = self.rows.get(rid)
            if got is None or start != got[0] + sum(len(c) for c in got[1]):  # new here (or computed afresh)
                self.rows[rid] = got = (start, [])
            got[1].append(own.clone())

    def take(self, rid: str, block_ids: list[int], num_tokens: int) -> tuple[int, torch.Tensor] | None:
        """The request's rows (its first position, and (tokens, width)), forgotten here: those of
        the tokens computed here (after a prefix-cache hit, from there)."""
        got = self.rows.pop(rid, None)
        return None if got is None else (got[0], torch.cat(got[1]))

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)


class DraftKVRecorder:
    """draft_model on a prefill instance's rank 0: the draft computes every prompt token beside the
    target, from the same step inputs, and each prompt's draft KV is shipped (DraftModel.prompt_kv)."""

    reads_target_hidden = False

    def __init__(self, draft):
        self.draft = draft  # draft_model.DraftModel
        self.observing = False  # from the worker's start

    @property
    def num_blocks(self) -> int:
        return self.draft.num_blocks

    def block_bytes(self) -> int:
        return self.draft.block_bytes()

    def give_pool(self, num_blocks: int) -> None:
        self.draft.give_pool(num_blocks)

    def observe(self, inp: ModelInput, hidden: torch.Tensor) -> None:
        if self.observing:  # its KV of the step's tokens, at their slots (one KV group: the target's first)
            self.draft.runner.hidden_states(inp)

    def take(self, rid: str, block_ids: list[int], num_tokens: int) -> tuple[int, torch.Tensor]:
        """Its KV of the prompt's every position (a prefix-cache hit's too: the request that computed
        those blocks computed its draft KV there)."""
        return 0, self.draft.prompt_kv(block_ids, num_tokens)

    def forget(self, rid: str) -> None:
        """It keeps nothing per request."""
