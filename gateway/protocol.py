"""OpenAI API request and response bodies (pydantic), and the checks that turn a request into
SamplingParams. Anything we do not support is refused with a 400 naming it, never ignored."""
from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Annotated, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from engine.core.request import MAX_PRIORITY, SamplingParams, prompt_misfit
from gateway.tools import check_tool_choice, named_schema, required_schema, validate_tools

# Accepted but without effect on generation (OpenAI bookkeeping fields).
IGNORED = {"user", "metadata", "store", "service_tier"}
# Accepted only at their neutral value.
NEUTRAL = {"best_of": 1, "echo": False, "suffix": None}
MAX_SEED = 2**63 - 1  # a torch.Generator's seed
MAX_N = 128  # choices per request (OpenAI's bound)
MAX_REQUEST_SALT_CHARS = 512  # a cache_salt (engine/core/request.py takes 1024: room for its key's name, isolate_cache)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI allows 20 in chat, 5 in completions; vLLM 20 in both)
# What one request may ask beyond its tokens, bounded because the work per token or per step grows with
# each (docs/gateway.md, "Bounds"): checked on the parsed JSON before any field is validated (`check_counts`).
MAX_STOP = 4  # stop strings (OpenAI's bound)
MAX_STOP_CHARS = 1024  # characters of one stop string (the stream lags by the longest one)
MAX_STOP_TOKEN_IDS = 1024  # vLLM's stop_token_ids (vLLM sets no bound)
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's bound)
MAX_TOOLS = 128  # function tools (OpenAI's bound)
MAX_PROMPT_CHARS_PER_TOKEN = 32  # a text prompt's characters per token the server takes, checked before tokenizing


def _json_integer(value):
    """JSON Schema's integer: 420 and 420.0, not false or "420" (the strict models take no bools or
    strings for numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                          and not value.is_integer()):
        raise ValueError("must be an integer")
    return int(value)


Int = Annotated[int, BeforeValidator(_json_integer)]


class APIError(Exception):
    """An error the client gets as an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _short(value, limit: int = 40) -> str:
    """`value`'s repr cut to `limit` characters: an error message names what it refuses, never echoes a body."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_counts(data: object) -> None:
    """APIError(400) naming the first list or map of a parsed body past its bound (the MAX_* above),
    with its length only, never its items. Runs before pydantic: an oversized field costs no validation."""
    if not isinstance(data, dict):
        return  # not an object: pydantic's 422
    stop = data.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in (stop if isinstance(stop, list) else [stop])):
        raise APIError(400, f"each stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    for name, kind, bound in (("stop_token_ids", list, MAX_STOP_TOKEN_IDS), ("logit_bias", dict, MAX_LOGIT_BIAS),
                              ("tools", list, MAX_TOOLS)):
        value = data.get(name)
        if isinstance(value, kind) and len(value) > bound:
            raise APIError(400, f"{name} takes at most {bound} {'entries' if kind is dict else 'items'}, "
                                f"got {len(value)}", param=name)


def parse_body(model: type[BaseModel], raw: bytes, content_type: str | None) -> BaseModel:
    """The body as `model`: JSON (Content-Type application/json or *+json), its counts within bounds
    (`check_counts`: 400), then validated (RequestValidationError: 422, FastAPI's own error list). Blocking:
    the gateway runs it on a worker thread (a large body takes a second to parse)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                       "msg": "the body must be JSON (Content-Type: application/json)"}])
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or a number past int's 4300 digits
        loc = ("body", exc.pos) if isinstance(exc, json.JSONDecodeError) else ("body",)
        raise RequestValidationError([{"type": "json_invalid", "loc": loc, "msg": "JSON decode error"}]) from None
    check_counts(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_input=False)]
                                     ) from None


class _Item(BaseModel):
    """A model a body may hold many of: the messages, their parts and tool calls."""

    # NOTE: a body is validated on a worker thread, but pydantic-core holds the GIL for all of one
    # validation unless it calls back into Python: this hook per item lets the event loop run between
    # items (6.6 MB of 150k messages: the loop's longest wait 0.43 s -> about 0.1 s).
    def model_post_init(self, context, /) -> None:
        pass


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class TextPart(_Item):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ToolCallFunction(_Item):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Item):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Item):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str | None:
        if self.content is None:
            return None
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self, index: int) -> dict:
        """The message as the chat template takes it (engine/text/tokenizer.py); APIError(400) if it cannot be."""
        where = f"messages[{index}]"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise APIError(400, f"{where}.content is required (only an assistant message with tool_calls may "
                                "omit it)", param=f"{where}.content")
        if self.tool_calls and self.role != "assistant":
            raise APIError(400, f"{where}: only assistant messages have tool_calls", param=f"{where}.tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise APIError(400, f"{where}: a tool message needs tool_call_id, and only a tool message has one",
                           param=f"{where}.tool_call_id")
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _bounded(**bounds) -> Field:
    """An optional field whose bounds the OpenAPI document states; `sampling_params` enforces them
    (a 400 naming the field, as OpenAI answers), not pydantic (which would answer 422)."""
    return Field(None, json_schema_extra=bounds)


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP = {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP}, {"type": "null"}]}
_LOGIT_BIAS = {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": MAX_LOGIT_BIAS,
                          "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                         {"type": "null"}]}


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON matching a schema."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (exactly one of them)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(BaseModel):
    # extras are refused by name in `sampling_params`; the document says no others are taken
    # strict: JSON types as the document states them (no false for 0, no "1" for 1)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})
    model: str
    max_tokens: Int | None = _bounded(minimum=1)
    temperature: float | None = _bounded(minimum=0, maximum=2)
    top_p: float | None = _bounded(exclusiveMinimum=0, maximum=1)
    top_k: Int | None = _bounded(minimum=0)  # a vLLM extension many clients use
    seed: Int | None = _bounded(minimum=0, maximum=MAX_SEED)
    stop: str | list[str] | None = Field(None, json_schema_extra=_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # a vLLM extension (benchmarks)
    cache_salt: str | None = None  # vLLM's: prompts of different salts share no prefix cache (docs/gateway.md)
    # vLLM's: its class, a lower value served first; absent: its API key's class (docs/gateway.md "Tenants")
    priority: Int | None = _bounded(minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY)
    presence_penalty: float | None = _bounded(minimum=-2, maximum=2)
    frequency_penalty: float | None = _bounded(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_LOGIT_BIAS)
    # vLLM extensions
    repetition_penalty: float | None = _bounded(exclusiveMinimum=0)
    min_tokens: Int | None = _bounded(minimum=0)
    min_p: float | None = _bounded(minimum=0, maximum=1)
    stop_token_ids: list[Int] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_STOP_TOKEN_IDS},
        {"type": "null"}]})
    n: Int | None = _bounded(minimum=1, maximum=MAX_N)  # prefilled once, forked on the decode instance
    response_format: ResponseFormat | None = None  # structured outputs (engine/sample/structured_output.py)
    structured_outputs: StructuredOutputs | None = None  # vLLM's form: json, regex, choice, grammar
    # accepted without effect (IGNORED), or only at their neutral value (NEUTRAL)
    best_of: Int | None = _bounded(minimum=1, maximum=1)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def structured_output(self) -> tuple[str, str] | None:
        """`(kind, spec)` for SamplingParams.structured_output, from `response_format` or vLLM's
        `structured_outputs`; APIError(400) when both, or several of the latter, are given."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and so is not None and rf.type != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if rf is not None and rf.type == "json_object":
            return ("json_object", "")
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            return ("json_schema", json.dumps(rf.json_schema.schema_))
        if so is None:
            return None
        given = {k: v for k, v in [("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None)] if v is not None}
        if len(given) != 1:
            raise APIError(400, f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                                f"got {sorted(given) or 'none'}", param="structured_outputs")
        (kind, value), = given.items()
        if kind == "json_object":
            return (kind, "")
        return (kind, value if isinstance(value, str) else json.dumps(value))

    def _logprobs(self) -> int | None:
        """How many top logprobs per token the request wants (None: no logprobs)."""
        return None

    @staticmethod
    def _check_top(name: str, value: int) -> int:
        if not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
        return value

    def sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                        max_prompt_tokens: int | None = None) -> SamplingParams:
        """Checks every field against what we support; raises APIError(400) naming the first that isn't.
        `max_prompt_tokens`: the server's bound on prompts (--max-prompt-tokens), below the context."""
        for name in sorted(set(self.model_extra or {}) | set(NEUTRAL)):
            value = getattr(self, name, None) if name not in (self.model_extra or {}) else self.model_extra[name]
            if name in IGNORED or value is None or (name in NEUTRAL and value in (NEUTRAL[name], {}, [])):
                continue
            raise APIError(400, f"unsupported parameter: {name}={_short(value)}", param=name)
        if why := prompt_misfit(prompt_len, max_model_len):
            raise APIError(400, why, param="messages" if hasattr(self, "messages") else "prompt",
                           code="context_length_exceeded" if prompt_len else None)
        if max_prompt_tokens is not None and prompt_len > max_prompt_tokens:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server takes at most {max_prompt_tokens} "
                                "prompt tokens (--max-prompt-tokens)",
                           param="messages" if hasattr(self, "messages") else "prompt", code="context_length_exceeded")
        room = max_model_len - prompt_len
        max_tokens = self._max_tokens()
        if max_tokens is not None and not 1 <= max_tokens <= room:
            raise APIError(400, f"max_tokens must be between 1 and {room} (context {max_model_len} minus "
                                f"{prompt_len} prompt tokens), got {max_tokens}", param="max_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop) or len(stop) > MAX_STOP:
            raise APIError(400, f"stop must be up to {MAX_STOP} non-empty strings", param="stop")
        checks = [("temperature", self.temperature, 0.0, 2.0), ("top_p", self.top_p, 1e-9, 1.0),
                  ("presence_penalty", self.presence_penalty, -2.0, 2.0),
                  ("frequency_penalty", self.frequency_penalty, -2.0, 2.0), ("min_p", self.min_p, 0.0, 1.0),
                  ("repetition_penalty", self.repetition_penalty, 1e-9, float("inf"))]
        for name, value, lo, hi in checks:
            if value is not None and not lo <= value <= hi:
                raise APIError(400, f"{name} must be in [{lo:g}, {hi:g}], got {value}", param=name)
        if self.top_k is not None and self.top_k < 0:
            raise APIError(400, f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2**63 - 1], got {self.seed}", param="seed")
        max_tokens = max_tokens or room
        if self.min_tokens is not None and not 0 <= self.min_tokens <= max_tokens:
            raise APIError(400, f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {self.min_tokens}",
                           param="min_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None
                              else self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=self.top_k or 0, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              logprobs=self._logprobs(), presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              min_tokens=self.min_tokens or 0, min_p=self.min_p or 0.0, n=self.n or 1,
                              structured_output=self.structured_output(),
                              logit_bias=self._logit_bias(vocab_size),
                              stop_token_ids=self._token_ids("stop_token_ids", self.stop_token_ids or [], vocab_size),
                              cache_salt=self._cache_salt(), priority=self._priority())

    def _priority(self) -> int:
        if self.priority is not None and not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise APIError(400, f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", param="priority")
        return self.priority or 0

    def _cache_salt(self) -> str | None:
        """The request's salt, at most MAX_REQUEST_SALT_CHARS (its key's name may go before it: isolate_cache)."""
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_REQUEST_SALT_CHARS:
            raise APIError(400, f"cache_salt must be 1 to {MAX_REQUEST_SALT_CHARS} characters", param="cache_salt")
        return self.cache_salt

    @staticmethod
    def _token_ids(name: str, ids: list[int], vocab_size: int) -> tuple[int, ...]:
        """`ids` as a tuple; APIError(400) naming the first one outside the vocabulary (only that one)."""
        if (bad := next((t for t in ids if not 0 <= t < vocab_size), None)) is not None:
            raise APIError(400, f"{name} must be token ids in [0, {vocab_size}), got {_short(bad)}", param=name)
        return tuple(ids)

    def _logit_bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """OpenAI's map of token ids (as strings) to a bias in [-100, 100]."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:  # no vocabulary has 10**12 tokens
                raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {_short(key)}",
                               param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias} for {_short(key)}",
                               param="logit_bias")
            out.append((int(digits), float(bias)))
        self._token_ids("logit_bias", [t for t, _ in out], vocab_size)
        return tuple(out)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = _bounded(minimum=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = _bounded(minimum=0, maximum=MAX_LOGPROBS)
    tools: list[dict] | None = Field(None, json_schema_extra={"anyOf": [  # OpenAI's function tools (gateway/tools.py)
        {"type": "array", "items": {"type": "object"}, "maxItems": MAX_TOOLS}, {"type": "null"}]})
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None  # with tool_choice "required": false allows one call only
    chat_template_kwargs: dict | None = None  # vLLM's: variables for the chat template (enable_thinking, ...)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI's; the template's variable (gpt-oss)

    def tool_setup(self) -> tuple[list[dict] | None, str | dict]:
        """The checked tools and tool choice ("none", "auto", "required" or the named tool's definition);
        APIError(400) naming what is wrong. Checked once (the prompt and the output format both ask)."""
        return self._tool_setup

    @functools.cached_property
    def _tool_setup(self) -> tuple[list[dict] | None, str | dict]:
        try:
            tools = validate_tools(self.tools) if self.tools else None
        except ValueError as exc:
            raise APIError(400, str(exc), param="tools") from None
        try:
            return tools, check_tool_choice(self.tool_choice, tools)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None

    def structured_output(self) -> tuple[str, str] | None:
        """A required or named tool choice is a JSON schema on the output (gateway/tools.py)."""
        fmt = super().structured_output()
        tools, choice = self.tool_setup()
        if choice in ("none", "auto"):
            return fmt
        if fmt is not None:
            raise APIError(400, "a required or named tool_choice fixes the output's format: no response_format "
                                "or structured_outputs with it", param="tool_choice")
        try:
            schema = required_schema(tools, self.parallel_tool_calls is not False) if choice == "required" \
                else named_schema(choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tools") from None
        return ("json_schema", json.dumps(schema))

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self._check_top("top_logprobs", self.top_logprobs or 0)


class CompletionRequest(_Sampling):
    prompt: str | list[Int] = Field(min_length=1, json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]})
    logprobs: Int | None = _bounded(minimum=0, maximum=MAX_LOGPROBS)
    echo: bool | None = Field(None, json_schema_extra={"enum": [False, None]})
    suffix: str | None = Field(None, json_schema_extra={"type": "null"})

    def _logprobs(self) -> int | None:
        return None if self.logprobs is None else self._check_top("logprobs", self.logprobs)


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
