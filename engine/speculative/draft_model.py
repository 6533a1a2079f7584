"""The draft-model proposer (`--speculative-model`): a small model of the target's vocabulary
guesses k tokens, one forward each, greedily.

The draft is loaded by the target's rank-0 runner before the target sizes its KV pool, so the
budget counts its weights and its share of each block (`DraftModelProposer.load_model`). It has its own KV pool of as
many blocks as the target's, of the target's block size, and reads the target's block tables: a
sequence's draft KV sits in the same block ids and slots as its target KV, so the scheduler
allocates and frees once for both (rejected drafts' slots are written again by the next step).
What the draft has computed of a sequence is remembered as the tokens it was fed: each `propose`
first feeds the tokens it lacks (after a rejection, the kept drafts and the target's token; on a
request's first step here, its whole prompt, unless a prefill instance shipped the prompt's draft
KV with the target's: `DraftModel.receive_rows`, engine/speculative/rows.py), then proposes.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.core.request import NewRequestData, SamplingParams, SchedulerOutput
from engine.speculative.base import PROFILE_CONTEXT, Proposer, SpecSequence

if TYPE_CHECKING:
    from engine.core.speculative_config import SpeculativeConfig
    from engine.speculative.base import TargetRunner

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
# the draft's prefill of a prompt (its first step here) goes this many tokens per step, the sequence not
# speculating until it is done: a 1,024-token prompt's took 0.6 s in one step for an 8-layer draft of
# SmolLM2 on 2 cores, and a step waits for it with its whole batch (BENCHMARKS.md, speculative decoding)
CATCH_UP_TOKENS = 256


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, model: DraftModel, target_vocab_size: int):
        self.model, self.draft, self.vocab_size = model, model.runner, target_vocab_size
        self.fed = model.fed  # request id -> (tokens fed, how many were its own)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetRunner | None) -> DraftModelProposer:
        assert isinstance(target.draft, DraftModel), "the target's rank-0 runner loads the draft (load_model)"
        return cls(target.draft, target.model_config.vocab_size)

    @property
    def rows_received(self) -> int:
        return self.model.rows_received

    @classmethod
    def load_model(cls, target: TargetRunner) -> DraftModel:
        return DraftModel(load_draft(target))

    def propose(self, seqs: Sequence[SpecSequence]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        step, caught_up = zip(*[self._catch_up(s) for s in seqs]) if seqs else ((), ())
        active = list(range(len(seqs)))
        while active:
            tokens = self._forward(list(step))
            step, still = [], []
            for i, t in zip(active, tokens):
                s = seqs[i]
                if not caught_up[i]:  # a chunk of a long prompt this step: no drafts yet
                    continue
                drafts[i].append(t)
                if len(drafts[i]) < s.k:
                    fed, _ = self.fed[s.request_id]
                    step.append(NewRequestData(s.request_id, [t], len(fed), (s.block_ids[0],), _GREEDY, True))
                    fed.append(t)
                    still.append(i)
            active = still
        return drafts

    def _catch_up(self, s: SpecSequence) -> tuple[NewRequestData, bool]:
        """The sequence's tokens the draft has no KV of (the last one at least: its logits propose),
        at most CATCH_UP_TOKENS of them; whether that reaches its last token."""
        fed, own = self.fed.get(s.request_id, ([], 0))
        valid = own
        while valid < min(len(fed), len(s.token_ids)) and fed[valid] == s.token_ids[valid]:
            valid += 1
        valid = min(valid, len(s.token_ids) - 1)
        end = min(len(s.token_ids), valid + CATCH_UP_TOKENS)
        self.fed[s.request_id] = (list(s.token_ids[:end]), end)
        data = NewRequestData(s.request_id, list(s.token_ids[valid:end]), valid, (s.block_ids[0],), _GREEDY, True)
        return data, end == len(s.token_ids)

    def _forward(self, reqs: list[NewRequestData]) -> list[int]:
        """One draft forward over `reqs`; each one's argmax, in order."""
        runner = self.draft
        sched = SchedulerOutput(new_requests=reqs)
        runner.update_states(sched)
        try:
            inp = runner.prepare_inputs(sched)
            logits = runner.execute_model(inp)
        finally:
            runner.update_states(SchedulerOutput(finished_req_ids=[r.request_id for r in reqs]))
        best = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        by_id = dict(zip(inp.sample_req_ids, best))
        return [by_id[r.request_id] for r in reqs]

    def forget(self, request_id: str) -> None:
        self.fed.pop(request_id, None)  # (model.fed)

    def profile_seconds(self, batch_sizes: Sequence[int], k: int, device: torch.device) -> tuple[float, ...]:
        """k draft decode steps per batch size (the catch-up of a kept run is taken as one of them)."""
        from engine.core.timing import best_seconds
        context = min(PROFILE_CONTEXT, self.draft.configured_max_model_len - k)
        return tuple(k * best_seconds(lambda: self.draft.profile_step(b, 1, context), device) for b in batch_sizes)


def load_draft(target: TargetRunner) -> TargetRunner:
    """The draft model's runner, loaded by the target's rank-0 runner before it sizes its KV pool:
    the device budget then counts the draft's weights, and `DraftModel.block_bytes` its share of each
    block. Its own pool comes once the target's is sized (`DraftModel.give_pool`). It runs eagerly: its CUDA
    graphs would capture a pool that is replaced."""
    tc = target.config
    spec = tc.speculative or tc.ship_proposer_rows  # a decode (colocated) instance's, or a prefill's
    if target.model_config.kv_layout.windows[0] is not None:
        raise ValueError(f"--speculative-model: {target.model_config.name}'s first KV group has a sliding window; "
                         "the draft reads that group's block tables, which drop blocks outside it")
    cache = replace(tc.cache, num_blocks=2, block_size=target.block_size)  # a placeholder pool
    # the target's own runner class (speculation sits below the runner and names no class of it)
    draft = type(target)(replace(tc, model=spec.model, tp_size=1, expert_parallel=False, expert_placement=None,
                                 quantization="auto", speculative=None, ship_proposer_rows=None, enforce_eager=True,
                                 cache=cache))
    why = _misfit(draft, target)
    if why is not None:
        raise ValueError(f"--speculative-model {spec.model}: {why}")
    return draft


class DraftModel:
    """The draft's runner as the target's rank-0 runner holds it (base.ProposerModel), and what it
    has computed of each sequence (`fed`: the proposer's)."""

    reads_target_hidden = False

    def __init__(self, runner: TargetRunner):
        self.runner = runner
        self.fed: dict[str, tuple[list[int], int]] = {}  # request id -> (tokens fed, how many were its own)
        self.rows_received = 0  # prompt positions whose draft KV came from prefill instances, since start

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def block_bytes(self) -> int:
        from engine.core.kv_cache import kv_block_bytes  # not at import: engine.core.config imports this package
        d = self.runner
        return kv_block_bytes(d.model_config, d.num_kv_heads, d.block_size, d.kv_dtype)

    def give_pool(self, num_blocks: int) -> None:
        """As many blocks as the target's (it reads the target's block tables)."""
        from engine.core.kv_cache import allocate_kv_cache
        d = self.runner
        d.kv_cache = None
        d.num_blocks = num_blocks
        d.kv_cache = allocate_kv_cache(d.model_config, d.num_kv_heads, num_blocks, d.block_size, d.kv_dtype, d.device)
        logger.info("speculative decoding: draft model %s on rank 0, %d KV blocks of %d tokens beside the target's "
                    "(%.2f GiB)", d.model_config.name, num_blocks, d.block_size,
                    num_blocks * self.block_bytes() / 2**30)

    def observe(self, inp, hidden) -> None:
        """The draft reads tokens only."""

    def prompt_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Its KV of a sequence's first `num_tokens` positions (in the target's blocks `block_ids`),
        a token's every layer's K and V side by side: (num_tokens, layers * 2 * kv heads * head_dim)."""
        pool, slots = self._pool(), self._slots(block_ids, 0, num_tokens)
        return pool[:, :, slots].permute(2, 0, 1, 3, 4).reshape(num_tokens, -1)

    def receive_rows(self, rid: str, start: int, rows: torch.Tensor, block_ids: list[int],
                     token_ids: list[int]) -> None:
        """A remote prefill's draft KV of the prompt's positions start .. (`prompt_kv` there, shipped
        with the target's KV into the same blocks): the sequence's prompt counts as fed."""
        pool, n = self._pool(), len(rows)
        pool[:, :, self._slots(block_ids, start, start + n)] = \
            rows.view(n, pool.shape[0], 2, *pool.shape[-2:]).permute(1, 2, 0, 3, 4).to(pool)
        self.fed[rid] = (list(token_ids[:start + n]), start + n)
        self.rows_received += n

    def _pool(self) -> torch.Tensor:
        """The pool as (layers, 2, slots, kv heads, head_dim); an fp8 pool's bytes (no fp8 index_put)."""
        kv = self.runner.kv_cache
        kv = kv.view(torch.uint8) if kv.dtype == torch.float8_e4m3fn else kv
        return kv.view(kv.shape[0], 2, -1, *kv.shape[-2:])

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.runner.block_size
        return torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(start, end)], device=self.runner.device)


def _misfit(draft: TargetRunner, target: TargetRunner) -> str | None:
    """Why the draft cannot propose for the target (None: it can)."""
    dc, tc = draft.model_config, target.model_config
    if dc.vocab_size > tc.vocab_size:
        return f"its vocabulary ({dc.vocab_size} tokens) is larger than the target's ({tc.vocab_size})"
    if dc.kv_layout.num_groups != 1 or dc.kv_layout.windows[0] is not None:
        return "it has sliding-window layers (the draft reads the target's full-attention block tables)"
    if draft.block_size != target.block_size:
        return f"its attention backend takes {draft.block_size}-token blocks, the target's {target.block_size}"
    if dc.max_position_embeddings < target.configured_max_model_len:
        return (f"it has {dc.max_position_embeddings} positions, fewer than the target's context "
                f"({target.configured_max_model_len}); lower --max-model-len")
    return None
