"""Shared request types: SamplingParams, RequestMessage, RequestStatus, Request, and the one admission check.

What crosses a process is immutable: a `RequestMessage` (a request to place, from the router or a
front end to an instance) and its `SamplingParams`. What an instance's scheduler changes is its own
`Request`, made from the message on arrival: its token history is `prompt_token_ids + output_token_ids`;
`num_computed_tokens` says how much of that history already has K/V in the paged cache.
"""
from __future__ import annotations

import enum
import functools
import time
from collections.abc import Container
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. User input: validated in `__post_init__`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # any of them ends generation, as EOS does (`stop_token_set`)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    # Logit processing, with vLLM's and OpenAI's meanings (engine/sample/sampling.py: the formulas, the order)
    presence_penalty: float = 0.0  # minus this once for every token the output already holds
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # a prompt or output token's logit divided by it (> 0), times it (< 0)
    min_tokens: int = 0  # EOS and stop_token_ids (and stop strings) held back until this many tokens
    min_p: float = 0.0  # after temperature: drop tokens below min_p x the likeliest one's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    n: int = 1  # choices from one prompt: prefilled once, forked on the decode instance (child i: seed + i)
    # (kind, spec) the output must match (engine/sample/structured_output.py): ("json_schema", schema as JSON text),
    # ("json_object", ""), ("regex", pattern), ("choice", JSON list of strings), ("grammar", Lark)
    structured_output: tuple[str, str] | None = None
    # a retry's (the router's): its prompt ends with this many tokens of its own output from an earlier
    # attempt; penalties, min_tokens' count and the grammar's state take them as output
    num_resumed_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` as a set: the decode scheduler asks it of every token sampled, in O(1)
        however many ids the request gave (not a field: the tuple is what crosses processes)."""
        return frozenset(self.stop_token_ids)

    def choice(self, index: int) -> SamplingParams:
        """Choice `index`'s own params once an n > 1 request forks: n = 1, seed + index (vLLM's child seeds)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the request's tokens (penalties, min_tokens, a grammar's state)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.structured_output is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def wants_extras(self) -> bool:
        """Whether each token comes with extras (engine/core/extras.py): a field asked for."""
        return self.logprobs is not None


def prompt_misfit(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt cannot run in a context of `max_model_len` tokens (None: it can). The one length
    check of admission: the gateway answers it with HTTP 400, both schedulers raise it as ValueError
    (`check_admission`)."""
    if num_prompt_tokens < 1:
        return "the prompt is empty: it must hold at least one token"
    if num_prompt_tokens >= max_model_len:
        return (f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} "
                f"(at most {max_model_len - 1} prompt tokens, so that one can be generated)")
    return None


def check_admission(req: Request, max_model_len: int, known_ids: Container[str] = (),
                    max_num_choices: int | None = None) -> None:
    """The one check an instance's scheduler (prefill or decode) makes before taking a request.

    Args:
        req: the request (its id, prompt and sampling params).
        max_model_len: the instance's context (`ModelRunner.max_model_len`).
        known_ids: the ids of the requests the scheduler holds: a new one's must differ.
        max_num_choices: how many sequences the instance runs side by side (a decode instance's
            `max_num_seqs`, which an n > 1 request's choices must fit); None where choices never run
            side by side (a prefill samples every choice's first token from one prompt's logits).
    Raises:
        ValueError: one line naming why the request is refused.
    """
    if req.request_id in known_ids:
        raise ValueError(f"duplicate request id {req.request_id!r}")
    if why := prompt_misfit(len(req.prompt_token_ids), max_model_len):
        raise ValueError(why)
    n = req.sampling_params.n
    if max_num_choices is not None and n > max_num_choices:
        raise ValueError(f"n={n} is more choices than this instance runs at once (max_num_seqs {max_num_choices})")


def choice_id(request_id: str, index: int) -> str:
    """The id choice `index` of an n > 1 request takes once forked (the one definition: the decode
    scheduler forks under it, the router and the offline front end address the choice by it)."""
    return f"{request_id}/{index}"


@dataclass(frozen=True)
class RequestMessage:
    """A request to place on an instance: what the router (or a front end) sends a prefill or decode
    instance, through a Ray call or in-process. Immutable, and nothing of how the instance runs it:
    each instance makes its own `Request` of it (`Request.from_message`), so two never share state."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    client_id: str = ""  # the router (one per gateway) that placed it: its outputs go there

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class Request:
    """One request's state in an instance's scheduler (mutable, never sent to another process)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # time.monotonic() where it arrived (no clock crosses a process)
    eos_token_ids: frozenset[int] = frozenset()  # the model's: any of them ends generation
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_extras: list[dict] = field(default_factory=list)  # one per output token when `wants_extras`
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    client_id: str = ""  # the router (one per gateway) that placed it: its outputs go there

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    @classmethod
    def from_message(cls, msg: RequestMessage, eos_token_ids: frozenset[int]) -> Request:
        """This instance's state of a request placed here: it arrives now and ends on the model's
        EOS set (`ModelConfig.eos_token_ids`)."""
        return cls(msg.request_id, list(msg.prompt_token_ids), msg.sampling_params, time.monotonic(), eos_token_ids,
                   client_id=msg.client_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
