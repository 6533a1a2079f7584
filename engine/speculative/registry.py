"""The speculative methods by name: `--speculative-method` -> its `Proposer` class, and what the
runner loads beside the target, and what a prefill instance ships for each method (rows.py's
recorders, `rows_signature`). The factory of this axis, beside its interface (base.py), which
imports no proposer; the method names themselves are the config's (engine/core/speculative_config.py
METHODS), and each has exactly one class here."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.speculative_config import METHODS, SHIPPED
from engine.loading.loader import load_model_config
from engine.speculative.base import Proposer
from engine.speculative.draft_model import DraftModel, DraftModelProposer, load_draft
from engine.speculative.eagle3 import Eagle3Proposer, eagle3_rows, eagle3_taps
from engine.speculative.mtp import MtpProposer, final_hidden
from engine.speculative.ngram import NgramProposer
from engine.speculative.rows import DraftKVRecorder, RowRecorder

if TYPE_CHECKING:
    from engine.core.config import ModelConfig
    from engine.core.speculative_config import SpeculativeConfig
    from engine.speculative.base import ProposerModel, TargetRunner

# --speculative-method name -> class
PROPOSERS: dict[str, type[Proposer]] = {cls.name: cls for cls in (NgramProposer, DraftModelProposer, Eagle3Proposer,
                                                                  MtpProposer)}
assert set(PROPOSERS) == set(METHODS), (sorted(PROPOSERS), METHODS)


def proposer_class(method: str) -> type[Proposer]:
    """The proposer class of a --speculative-method name. Raises ValueError for an unknown one."""
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[method]


def create_proposer(config: SpeculativeConfig, target: TargetRunner | None = None) -> Proposer:
    """A proposer by its --speculative-method name. Raises ValueError for an unknown one."""
    return proposer_class(config.method).from_config(config, target)


def load_proposer_model(target: TargetRunner) -> ProposerModel | RowRecorder | DraftKVRecorder | None:
    """What speculative decoding runs beside the target on its rank 0, loaded before the KV pool is
    sized so that the budget counts it: a decode instance's draft model or head
    (`Proposer.load_model`), or a prefill instance's recorder of what it ships of each prompt
    (rows.py); else None."""
    spec, ship = target.config.speculative, target.config.ship_proposer_rows
    if target.tp.rank > 0 or not (spec or ship):
        return None
    return proposer_class(spec.method).load_model(target) if spec else row_recorder(ship, target)


def rows_signature(spec: SpeculativeConfig | None, model_config: ModelConfig, dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> str:
    """What a prefill instance ships of each prompt for a decode instance's proposer ("": nothing):
    both ends of a KV transfer compute it from their configs, and must agree (CompatRecord.proposer_rows)."""
    if spec is None or spec.method not in SHIPPED:
        return ""
    if spec.method == "draft_model":
        dc = load_model_config(spec.model)
        width = dc.kv_layout.num_slabs * 2 * dc.num_kv_heads * dc.head_dim
        return f"draft_model: KV of {dc.name}, {width} wide, {str(kv_dtype).removeprefix('torch.')}"
    dtype = str(dtype).removeprefix("torch.")
    if spec.method == "eagle3":
        ids = eagle3_rows(spec.model, model_config.num_layers)
        return f"eagle3: inputs of layers {','.join(map(str, ids))}, {3 * model_config.hidden_size} wide, {dtype}"
    return f"mtp: final hidden states, {model_config.hidden_size} wide, {dtype}"


def row_recorder(spec: SpeculativeConfig, target: TargetRunner) -> RowRecorder | DraftKVRecorder:
    """A prefill instance's recorder of what the decode instances' proposer needs of each prompt."""
    if spec.method == "draft_model":
        return DraftKVRecorder(DraftModel(load_draft(target)))
    if spec.method == "eagle3":
        return RowRecorder(eagle3_taps(target, spec.model))
    return RowRecorder(final_hidden)
