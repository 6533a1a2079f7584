"""What the scheduler asks one step to compute, and what the runner gives back.

New requests (first step, or resumed after preemption) carry full data; requests the runner
already holds carry only what changed. The runner keeps each request's block table between
steps and drops it when the request appears in `finished_req_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.extras import Extras
from engine.core.request import SamplingParams


@dataclass
class TokenHistory:
    """A request's tokens as the sampler needs them (runner state, one per request)."""
    prompt: frozenset[int] | list[int] = frozenset()  # its distinct tokens are what counts
    output: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # what min_tokens holds back: EOS (unless ignored), stop_token_ids
    num_resumed: int = 0  # the first tokens of `output` came in the prompt (a retry: SamplingParams.num_resumed_tokens)


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # tokens to compute this step, starting at position num_computed_tokens
    num_computed_tokens: int  # tokens whose K/V are already in the cache (prefix hits)
    block_ids: tuple[list[int], ...]  # the whole block table of each KV group (ModelConfig.kv_layout)
    sampling_params: SamplingParams
    sample: bool  # True when this step reaches the end of the known tokens: sample the next one
    history: TokenHistory | None = None  # its tokens, where its sampling controls read them (history_of)
    num_draft_tokens: int = 0  # as CachedRequestData's (a load-time profile's verify steps)


@dataclass
class CachedRequestData:
    request_id: str
    token_ids: list[int]  # tokens to compute this step (a decode: the last sampled token)
    num_computed_tokens: int
    new_block_ids: tuple[list[int], ...]  # per KV group, appended to the block table the runner holds; () none
    sample: bool
    num_null_blocks: tuple[int, ...] = ()  # per KV group, leading entries now the null block (freed
    # outside a sliding window); () for none
    num_draft_tokens: int = 0  # speculative decoding: token_ids ends with this many drafts, each
    # position sampled and verified (engine/speculative/verify.py)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the runner forgets these
    kv_transfer_meta: Any = None  # opaque to the runner; read by the KV connector
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy first
    # (the partial last prompt block of a forked choice: KVCacheManager.fork)
    # a host tier's (engine/core/host_tier.py), before the block copies: offloads, then reloads
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)  # (block, host slot)
    kv_reloads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, block)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.new_requests) + sum(len(r.token_ids) for r in self.cached_requests)

    @property
    def is_empty(self) -> bool:
        return not self.new_requests and not self.cached_requests


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> next token
    # each token's extras (engine/core/extras.py), carried unread: only requests that asked
    extras: dict[str, Extras] = field(default_factory=dict)
    # n > 1 (a prompt's first tokens): every choice's (token, extras or None); choice 0 is the above
    choices: dict[str, list[tuple[int, Extras | None]]] = field(default_factory=dict)
    # speculative decoding: a verifying request's kept drafts and one more token (in place of the above)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_extras: dict[str, list[Extras]] = field(default_factory=dict)  # only requests that asked
