"""OpenAI API request and response bodies (pydantic), and the checks that turn a request into
SamplingParams. Anything we do not support is refused with a 400 naming it, never ignored."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.request import SamplingParams

# Accepted but without effect on generation (OpenAI bookkeeping fields).
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Accepted only at their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "n": 1, "best_of": 1,
           "echo": False, "suffix": None, "tools": None, "tool_choice": None, "response_format": None}
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI allows 20 in chat, 5 in completions; vLLM 20 in both)


class APIError(Exception):
    """An error the client gets as an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are refused by name in `sampling_params`
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # a vLLM extension many clients use
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # a vLLM extension (benchmarks)
    # neutral-only fields, declared so their types are checked
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        """How many top logprobs per token the request wants (None: no logprobs)."""
        return None

    @staticmethod
    def _check_top(name: str, value: int) -> int:
        if not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
        return value

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """Checks every field against what we support; raises APIError(400) naming the first that isn't."""
        for name in sorted(set(self.model_extra or {}) | set(NEUTRAL)):
            value = getattr(self, name, None) if name not in (self.model_extra or {}) else self.model_extra[name]
            if name in IGNORED or value is None or (name in NEUTRAL and value in (NEUTRAL[name], {}, [])):
                continue
            raise APIError(400, f"unsupported parameter: {name}={value!r}", param=name)
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}",
                           param="messages" if hasattr(self, "messages") else "prompt",
                           code="context_length_exceeded")
        max_tokens = self._max_tokens()
        if max_tokens is not None and not 1 <= max_tokens <= room:
            raise APIError(400, f"max_tokens must be between 1 and {room} (context {max_model_len} minus "
                                f"{prompt_len} prompt tokens), got {max_tokens}", param="max_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop) or len(stop) > 4:
            raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
        checks = [("temperature", self.temperature, 0.0, 2.0), ("top_p", self.top_p, 1e-9, 1.0)]
        for name, value, lo, hi in checks:
            if value is not None and not lo <= value <= hi:
                raise APIError(400, f"{name} must be in [{lo:g}, {hi:g}], got {value}", param=name)
        if self.top_k is not None and self.top_k < 0:
            raise APIError(400, f"top_k must be >= 0, got {self.top_k}", param="top_k")
        return SamplingParams(max_tokens=max_tokens or room, temperature=1.0 if self.temperature is None
                              else self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=self.top_k or 0, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              logprobs=self._logprobs())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self._check_top("top_logprobs", self.top_logprobs or 0)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None

    def _logprobs(self) -> int | None:
        return None if self.logprobs is None else self._check_top("logprobs", self.logprobs)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
