"""A prefill instance's side of a speculative head (heads.py): the rows of each prompt that the
decode instances' head reads, recorded on rank 0 and shipped with the prompt's KV
(PrefillConnector.finish; kvtransfer/wire.py `rows`), and what both ends agree is shipped.

    runner.draft = row_recorder(spec, runner)      # ModelRunner, for config.ship_proposer_rows
    start, rows = runner.draft.take(request_id)    # after the prompt's last chunk
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.speculative.config import HEAD_METHODS

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.model_runner import ModelInput, ModelRunner
    from engine.speculative.config import SpeculativeConfig


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
        offset = 0
        for rid, start, n in inp.spans:
            got = self.rows.get(rid)
            if got is None or start != got[0] + sum(len(c) for c in got[1]):  # new here (or computed afresh)
                self.rows[rid] = got = (start, [])
            got[1].append(rows[offset:offset + n].clone())
            offset += n

    def take(self, rid: str) -> tuple[int, torch.Tensor] | None:
        """The request's rows (its first position, and (tokens, width)), forgotten here."""
        got = self.rows.pop(rid, None)
        return None if got is None else (got[0], torch.cat(got[1]))

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)


def rows_signature(spec: SpeculativeConfig | None, model_config: ModelConfig, dtype: torch.dtype) -> str:
    """What a prefill instance ships of each prompt for a decode instance's head ("": nothing):
    both ends of a KV transfer compute it from their configs, and must agree (CompatRecord.proposer_rows)."""
    if spec is None or spec.method not in HEAD_METHODS:
        return ""
    dtype = str(dtype).removeprefix("torch.")
    if spec.method == "eagle3":
        from engine.speculative.eagle3 import eagle3_rows
        ids = eagle3_rows(spec.model, model_config.num_layers)
        return f"eagle3: inputs of layers {','.join(map(str, ids))}, {3 * model_config.hidden_size} wide, {dtype}"
    return f"mtp: final hidden states, {model_config.hidden_size} wide, {dtype}"


def row_recorder(spec: SpeculativeConfig, target: ModelRunner) -> RowRecorder:
    """A prefill instance's recorder of the rows the decode instances' head reads."""
    if spec.method == "eagle3":
        from engine.speculative.eagle3 import eagle3_taps
        return RowRecorder(eagle3_taps(target, spec.model))
    from engine.speculative.mtp import final_hidden
    return RowRecorder(final_hidden)
