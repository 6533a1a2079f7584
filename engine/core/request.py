"""Shared request types: SamplingParams, RequestMessage, RequestStatus, Request, and the one admission check;
a step's input and output (SchedulerOutput, RunnerOutput); the prefill-to-decode Handover.

What crosses a process is immutable: a `RequestMessage` (a request to place, from the router or a
front end to an instance) and its `SamplingParams`. What an instance's scheduler changes is its own
`Request`, made from the message on arrival: its token history is `prompt_token_ids + output_token_ids`;
`num_computed_tokens` says how much of that history already has K/V in the paged cache.

The step's interface (`SchedulerOutput`, `RunnerOutput`): what the scheduler asks one step to compute,
and what the runner gives back.

New requests (first step, or resumed after preemption) carry full data; requests the runner
already holds carry only what changed. The runner keeps each request's block table between
steps and drops it when the request appears in `finished_req_ids`.

`Handover`: what a prefill instance hands a decode instance with a request's KV: the first token and,
when the request asked, its extras (engine/core/extras.py: logprobs); with n > 1, the other choices'
first tokens (each sampled from the same logits); and a speculative proposer's rows of the prompt
(engine/speculative/rows.py), when the two instances ship them. One message, packed by the prefill's
rank 0 into the KV transfer's trailer (kvtransfer/base.py: bytes the transport carries unread) and
unpacked by the decode's rank 0 as the request's KV is complete.

Packed with msgpack as a map {t: first token, x: extras or nil, c: choices as [[token, extras or
nil], ...], rows: nil or [first position, width, dtype, bytes]}. `Handover.unpack` checks every
field's type and shape (the extras' fields by engine/core/extras.py FIELDS) and raises HandoverError
naming the first one wrong: a malformed trailer fails its request, never the instance.

A new per-token output field changes nothing here (it is one of the extras), nor the transport.
Both ends name the format (`trailer_format`) in their KV compat record."""
from __future__ import annotations

import enum
import functools
import time
from collections.abc import Container
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import torch

from engine.core.extras import Extras, misfit
from engine.core.tier_copies import TierCopies


MAX_CACHE_SALT_CHARS = 1024
MAX_PRIORITY = 2**31 - 1  # |priority|: an int32, as vLLM takes it


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
    # vLLM's cache_salt: its prefix blocks' hashes start from the salt (engine/core/block_manager.py), so
    # requests of different salts never share a KV block in any tier (a tenant cannot time another's
    # prompts). Here, not on the request: the one record of its options every process and retry carries.
    cache_salt: str | None = None
    # vLLM's priority: its class; a lower value is served first (engine/core/priority.py), 0 by default
    priority: int = 0

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
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or abs(self.priority) > MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")

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
                    max_num_choices: int | None = None, vocab_size: int | None = None) -> None:
    """The one check an instance's scheduler (prefill or decode) makes before taking a request.

    Args:
        req: the request (its id, prompt and sampling params).
        max_model_len: the instance's context (`ModelRunner.max_model_len`).
        known_ids: the ids of the requests the scheduler holds: a new one's must differ.
        max_num_choices: how many sequences the instance runs side by side (a decode instance's
            `max_num_seqs`, which an n > 1 request's choices must fit); None where choices never run
            side by side (a prefill samples every choice's first token from one prompt's logits).
        vocab_size: the model's; a prompt token outside [0, vocab_size) is refused (None: not checked).
    Raises:
        ValueError: one line naming why the request is refused.
    """
    if req.request_id in known_ids:
        raise ValueError(f"duplicate request id {req.request_id!r}")
    if why := prompt_misfit(len(req.prompt_token_ids), max_model_len):
        raise ValueError(why)
    if vocab_size is not None and not 0 <= min(req.prompt_token_ids) <= max(req.prompt_token_ids) < vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}): the model's vocabulary")
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
    trace_context: str = ""  # the W3C traceparent of the router's attempt span; "": not traced

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
    trace_context: str = ""  # its RequestMessage's: the instance's spans go under it ("": not traced)

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    @classmethod
    def from_message(cls, msg: RequestMessage, eos_token_ids: frozenset[int]) -> Request:
        """This instance's state of a request placed here: it arrives now and ends on the model's
        EOS set (`ModelConfig.eos_token_ids`)."""
        return cls(msg.request_id, list(msg.prompt_token_ids), msg.sampling_params, time.monotonic(), eos_token_ids,
                   client_id=msg.client_id, trace_context=msg.trace_context)

    @property
    def priority(self) -> int:
        """Its class: a lower value is served first (SamplingParams.priority)."""
        return self.sampling_params.priority

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
    # the tiers' copies (engine/core/host_tier.py, engine/core/tier_copies.py), before the block copies
    kv_tier: TierCopies | None = None

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


FORMAT = "handover-2"
ROW_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
_FIELDS = {"t", "x", "c", "rows"}


class HandoverError(ValueError):
    """A trailer that is not a well-formed handover."""


def trailer_format(rows_signature: str) -> str:
    """The compat record's name of what the trailers hold: this format, and the proposer rows they
    carry (engine/speculative/registry.py rows_signature; "" none), on which both ends must agree."""
    return FORMAT + (f"+rows:{rows_signature}" if rows_signature else "")


@dataclass(frozen=True)
class Handover:
    first_token: int
    extras: Extras | None = None  # the first token's, when the request asked for any
    more_choices: tuple = ()  # n > 1: the other choices' (first token, extras or None)
    rows: tuple[int, torch.Tensor] | None = None  # a proposer's rows of the prompt: (first position, (tokens, width))

    def pack(self) -> bytes:
        rows = None
        if self.rows is not None:
            start, tensor = self.rows
            tensor = tensor.detach().to("cpu").contiguous()
            rows = [start, tensor.shape[1], str(tensor.dtype).removeprefix("torch."),
                    tensor.view(torch.uint8).numpy().tobytes()]
        return msgpack.packb({"t": self.first_token, "x": self.extras,
                              "c": [[token, extras] for token, extras in self.more_choices], "rows": rows})

    @classmethod
    def unpack(cls, data: bytes) -> Handover:
        """Raises HandoverError (one line) for anything but what `pack` makes."""
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=False)  # extras map token ids
        except Exception as exc:  # msgpack's errors have no common base but Exception
            raise HandoverError(f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(msg, dict) or set(msg) != _FIELDS:
            raise HandoverError(f"fields {sorted(msg) if isinstance(msg, dict) else type(msg).__name__}, "
                                f"want {sorted(_FIELDS)}")
        if type(msg["t"]) is not int or msg["t"] < 0:
            raise HandoverError("the first token is not a token id")
        if not isinstance(msg["c"], list) or not all(_is_choice(c) for c in msg["c"]):
            raise HandoverError("the choices are not [token id, extras or nil] pairs")
        for extras in [msg["x"], *(c[1] for c in msg["c"])]:
            wrong = None if extras is None else misfit(extras)
            if wrong is not None:
                raise HandoverError(wrong)
        return cls(msg["t"], msg["x"], tuple((token, extras) for token, extras in msg["c"]), _unpack_rows(msg["rows"]))


def _unpack_rows(rows) -> tuple[int, torch.Tensor] | None:
    if rows is None:
        return None
    if not (isinstance(rows, list) and len(rows) == 4 and type(rows[0]) is int and rows[0] >= 0
            and type(rows[1]) is int and rows[1] > 0 and rows[2] in ROW_DTYPES and isinstance(rows[3], bytes)):
        raise HandoverError("rows are not [first position, width, dtype, bytes]")
    start, width, dtype, data = rows[0], rows[1], ROW_DTYPES[rows[2]], rows[3]
    if not data or len(data) % (width * dtype.itemsize):
        raise HandoverError(f"{len(data)} bytes of rows {width} {rows[2]} wide")
    return start, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(-1, width)


def _is_choice(choice) -> bool:
    return isinstance(choice, list) and len(choice) == 2 and type(choice[0]) is int and choice[0] >= 0
