"""The step: what every rank of a tensor-parallel instance runs, and the records that cross its
control channel with it.

    rank 0: SchedulerOutput -> ModelRunner.prepare_inputs() -> ModelInput -> TPGroup.broadcast_step
    ranks > 0:                                                 ModelInput <- TPGroup.broadcast_step

`ModelInput` is plain tensors plus the attention metadata (engine/runner/model_runner.py builds
it); `engine_types` names the engine's records that may cross (engine/parallel/tp_wire.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata
from engine.core.choices import MethodChoice, PrefillForms
from engine.core.tier_copies import TierCopies
from engine.parallel.tp_comm import TensorSlot


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    metas: tuple[AttentionMetadata, ...]  # per KV group (ModelConfig.kv_layout): their tables and slots differ
    sample_indices: torch.Tensor  # (num_rows,) flat index of the last token of each sampled sequence (of each
    # of its positions, for a sequence with drafts)
    sample_req_ids: list[str]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, before the forward
    kv_tier: TierCopies | None = None  # the tiers' copies (engine/core/tier_copies.py), first of all
    # speculative decoding: request id -> (position of its first token, its drafts); every position sampled
    drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # per request: (id, first position, tokens)

    @property
    def meta(self) -> AttentionMetadata:
        """The first KV group's (the only one, for most models)."""
        return self.metas[0]


def engine_types() -> tuple[type, ...]:
    """The engine's records that cross a TP group: the step (ModelInput and its metadata, the
    broadcast's tensor slots) and the load-time choices rank 0 makes for all (expert methods, MLA
    prefill forms: engine/core/choices.py). Layers above add their own (TPGroup.wire_types)."""
    return ModelInput, AttentionMetadata, MethodChoice, PrefillForms, TensorSlot, TierCopies
