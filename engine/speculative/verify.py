"""The runner's half of speculative decoding: a step's drafts checked against the target's logits.

A speculating sequence computes its last token and its k drafts in one forward; the logits of all
k + 1 positions are sampled (ModelInput.drafts). Row i is processed as if the drafts before it
were output already: the penalties and min_tokens read them, the grammar's mask is the one after
them (GrammarState.fill_bitmasks_along). The rejection sampler (rejection.py) then keeps the drafts
the target agrees with, plus one token. After it: the sequence's history and grammar advance by the
kept tokens only, and its block tables drop the blocks past them (the scheduler drops the same:
KVCacheManager.trim).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.request import TokenHistory
from engine.sample.sampling import (is_greedy, keep_grammar_tokens, needs_processing, probabilities, process_logits,
                                    token_extras)
from engine.speculative.rejection import rejection_sample

if TYPE_CHECKING:
    from engine.core.request import RunnerOutput
    from engine.parallel.step import ModelInput
    from engine.speculative.base import TargetRunner


@dataclass(frozen=True)
class Verifying:
    request_id: str
    row: int  # its first logits row
    start: int  # the position of its first token this step
    drafts: list[int]


def split_rows(inp: ModelInput) -> tuple[list[int], list[str], list[Verifying]]:
    """The logits rows of a step: (rows of plain requests, their ids, the verifying requests)."""
    rows, ids, verifying, row = [], [], [], 0
    for rid in inp.sample_req_ids:
        if rid in inp.drafts:
            start, drafts = inp.drafts[rid]
            verifying.append(Verifying(rid, row, start, drafts))
            row += 1 + len(drafts)
        else:
            rows.append(row)
            ids.append(rid)
            row += 1
    return rows, ids, verifying


def verify(runner: TargetRunner, logits: torch.Tensor, verifying: list[Verifying], out: RunnerOutput) -> None:
    """Fills `out.spec_token_ids` (and `out.spec_extras`) of each verifying request: its kept
    drafts and one more token; advances its history and grammar; trims its block tables."""
    states = [runner.requests[v.request_id] for v in verifying]
    index = torch.tensor([v.row + i for v in verifying for i in range(len(v.drafts) + 1)], device=logits.device)
    raw = logits[index].float()  # (rows, vocab): the model's, for the extras
    params, histories, grammars = [], [], []
    for v, s in zip(verifying, states):
        for i in range(len(v.drafts) + 1):
            params.append(s.sampling_params)
            histories.append(_along(s.history, v.drafts[:i]))
            grammars.append(s.grammar)
    processed = _processed(raw, verifying, states, params, histories, grammars)
    first = 0
    for v, s in zip(verifying, states):
        n = len(v.drafts) + 1
        rows, p = processed[first:first + n], s.sampling_params
        drafts = torch.tensor([v.drafts], device=rows.device)
        if is_greedy(p):
            tokens = rejection_sample(rows[None], drafts, greedy=True)[0]
        else:
            tokens = rejection_sample(probabilities(rows, [p] * n)[None], drafts, generator=s.generator)[0]
        out.spec_token_ids[v.request_id] = tokens
        if p.wants_extras:
            kept = torch.tensor(tokens, device=raw.device)
            out.spec_extras[v.request_id] = token_extras(raw[first:first + len(tokens)], kept, [p] * len(tokens))
        _advance(runner, v, s, tokens)
        first += n


def _along(history: TokenHistory | None, drafts: list[int]) -> TokenHistory | None:
    """The history a draft's row is processed with: the drafts before it taken as output."""
    if history is None or not drafts:
        return history
    return TokenHistory(history.prompt, history.output + drafts, history.stop_ids, history.num_resumed)


def _processed(raw: torch.Tensor, verifying: list[Verifying], states: list, params: list, histories: list,
               grammars: list) -> torch.Tensor:
    """Every row's logits after its grammar's mask along the drafts and its logit processing."""
    logits, masked = raw, any(g is not None for g in grammars)
    if masked:
        logits = raw.clone()
        _apply_masks_along(logits, verifying, states)
    if any(needs_processing(p) for p in params):
        processed = process_logits(logits.clone(), params, histories)
        logits = keep_grammar_tokens(processed, logits, grammars) if masked else processed
    return logits


def _apply_masks_along(logits: torch.Tensor, verifying: list[Verifying], states: list) -> None:
    """In place: each grammar row's forbidden tokens to -inf, the masks taken along its drafts."""
    import llguidance.numpy as llg_numpy

    from engine.sample.structured_output import apply_bitmask

    width = next(s.grammar.vocab_size for s in states if s.grammar is not None)
    bitmask = torch.from_numpy(llg_numpy.allocate_token_bitmask(logits.shape[0], width))
    rows, first = [], 0
    for v, s in zip(verifying, states):
        n = len(v.drafts) + 1
        if s.grammar is not None:
            s.grammar.fill_bitmasks_along(v.drafts, bitmask, first)
            rows += range(first, first + n)
        first += n
    apply_bitmask(logits, rows, bitmask[rows], width)


def _advance(runner: TargetRunner, v: Verifying, state, tokens: list[int]) -> None:
    """The kept tokens join the request's history and grammar; its tables keep the blocks of the
    tokens whose KV is now valid (this step's first token and the kept drafts)."""
    if state.history is not None:
        state.history.output.extend(tokens)
    if state.grammar is not None:
        for t in tokens:
            state.grammar.accept(t)
    keep = -(-(v.start + len(tokens)) // runner.block_size)
    for table in state.block_ids:
        del table[keep:]
