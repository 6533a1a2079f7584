"""The OpenAI-compatible HTTP gateway (FastAPI). Tokenizes once here, sends token ids through
the router, detokenizes the streamed tokens incrementally (stop strings cut here too).

    POST /v1/chat/completions, /v1/completions   (stream or not)
    GET  /v1/models, /health, /ready, /metrics, /status
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from contextlib import contextmanager
from typing import Callable, Sequence

import jinja2

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.request import SamplingParams
from engine.sample import structured_output
from engine.text.tokenizer import TextState
from gateway.session import ChatOutput, Choice, Generation
from gateway.logprobs import LogprobsFormatter
from gateway.reasoning import get_reasoning_parser
from gateway.tool_parsers import get_tool_parser
from gateway import openapi
from gateway.api_keys import NO_KEY, APIKey, configured_keys
from gateway.guard import DEFAULT_MAX_REQUEST_BYTES, APIKeyManager, RequestGuard
from gateway.limit_scripts import SharedLimits
from gateway.limits import Hold, KeyLimitError, tenant_class
from gateway.metrics import GatewayMetrics
from gateway.trace import RequestTrace, server_timing
from gateway.protocol import (MAX_PROMPT_CHARS_PER_TOKEN, APIError, ChatCompletionRequest, CompletionRequest,
                              make_id, now, parse_body)
from router.router import QueueFullError

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
SESSION_HEADER = "x-session-id"  # a request of a session goes where its last one ran (router/policy.py)
MAX_SESSION_CHARS = 256  # what the router keeps of a session's name
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # set by the gateway


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return _error_response(APIError(422, f"invalid request body: {msg}", param=loc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type_, headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error (API key %s)", getattr(request.state, "api_key_name", NO_KEY))
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", "internal_error"))


class _Gateway:
    """What the routes share: the cluster, tokenizer, limits and metrics."""

    def __init__(self, cluster, tokenizer, model_name: str, max_model_len: int | None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 max_prompt_tokens: int | None = None, session_affinity: str = "header", return_timings: bool = False):
        self.cluster, self.tokenizer, self.model_name = cluster, tokenizer, model_name
        self.return_timings = return_timings  # usage.timings and Server-Timing (gateway/trace.py)
        self.session_affinity = session_affinity
        self._max_model_len, self.max_prompt_tokens = max_model_len, max_prompt_tokens
        self.tool_parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)
        self.reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        self.metrics = GatewayMetrics(cluster)

    @property
    def max_model_len(self) -> int:
        """Fixed at creation, or (None) the cluster's now: instances a controller owns come and go."""
        return self._max_model_len if self._max_model_len is not None else self.cluster.max_model_len

    def check_ready(self) -> None:
        if not self.cluster.ready():
            raise APIError(503, "not ready: need a healthy decode instance (and prefill, disaggregated)",
                           "service_unavailable", headers={"Retry-After": RETRY_AFTER_S})

    def check_structured_output(self, kind: str, spec: str) -> None:
        """APIError(400) naming what is wrong with a response format before any work starts."""
        eos = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        try:
            structured_output.check(kind, spec, structured_output.ll_tokenizer(self.tokenizer,
                                                                               self.tokenizer.vocab_size, eos))
        except ValueError as exc:
            param = "response_format" if kind in ("json_schema", "json_object") else "structured_outputs"
            raise APIError(400, str(exc), param=param) from None

    def chat_prompt(self, body: ChatCompletionRequest, marks: list | None = None
                    ) -> tuple[list[int], Callable[[], ChatOutput]]:
        """The chat's prompt ids (the chat template, with the tools) and a maker of each choice's output
        shaping (reasoning, tool calls); APIError(400) naming what cannot work, before any work starts.
        `marks` gets the template's and the tokenizer's (name, start, end) in time.time_ns()."""
        start = time.time_ns()
        if self.tokenizer.chat_template is None:  # a GGUF or folder without one: completions still work
            raise APIError(400, f"the model {self.model_name!r} has no chat template, so it cannot serve chat "
                                "completions: restart the server with --chat-template FILE (a Jinja chat template), "
                                "or use /v1/completions", code="chat_template_missing")
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        tools, choice = body.tool_setup()
        if tools and not self.tokenizer.supports_tools:
            raise APIError(400, "this model's chat template takes no tools: serve it with a --chat-template that "
                                "does", param="tools")
        if tools and choice == "auto" and self.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" needs a tool-call parser: serve the model with '
                                '--tool-call-parser, or ask for "required" or a named function', param="tool_choice")
        kwargs = dict(body.chat_template_kwargs or {})
        if clash := sorted(set(kwargs) & _TEMPLATE_OWN):
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
        if body.reasoning_effort is not None:  # a template variable, as vLLM passes it (gpt-oss's template reads it)
            if kwargs.setdefault("reasoning_effort", body.reasoning_effort) != body.reasoning_effort:
                raise APIError(400, "reasoning_effort differs from chat_template_kwargs.reasoning_effort",
                               param="reasoning_effort")
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs, **({"tools": tools} if tools else {}))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        self.check_prompt_chars(text, "messages")
        in_reasoning = self.reasoning is not None and self.reasoning.starts_in_reasoning(text)
        mode = None if not tools or choice == "none" else choice if isinstance(choice, str) else "named"
        name = choice["function"]["name"] if mode == "named" else None
        templated = time.time_ns()
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
        if marks is not None:
            marks += [("template", start, templated), ("tokenize", templated, time.time_ns())]
        return ids, lambda: ChatOutput(self.reasoning, in_reasoning, mode, self.tool_parser, name)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """APIError(400) for a text prompt too long to be within the prompt bound however it tokenizes
        (MAX_PROMPT_CHARS_PER_TOKEN characters per token): tokenizing it would be work for nothing."""
        tokens = self.max_prompt_tokens or self.max_model_len
        if not tokens:  # no instance known yet, so no bound to apply: not ready (503), never a 400
            self.check_ready()
            return
        if len(text) > (bound := MAX_PROMPT_CHARS_PER_TOKEN * tokens):
            raise APIError(400, f"the prompt has {len(text)} characters; this server takes at most {tokens} prompt "
                                f"tokens, so at most {bound} characters ({MAX_PROMPT_CHARS_PER_TOKEN} per token)",
                           param=param, code="context_length_exceeded")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, list):
            return list(body.prompt)
        self.check_prompt_chars(body.prompt, "prompt")
        return self.tokenizer.encode(body.prompt)

    async def prepare(self, request: Request, model: type[ChatCompletionRequest] | type[CompletionRequest]
                      ) -> _Prepared:
        """The request's body parsed, checked and tokenized on a worker thread (each may take a second
        for a large body; the event loop goes on serving meanwhile)."""
        raw = await request.body()
        prep = await run_in_threadpool(self._prepare, raw, request.headers.get("content-type"), model)
        prep.session = self.session_of(request, prep.body)
        if key_salt := getattr(request.state, "api_key_cache_salt", None):  # its key isolates its cache
            salt = prep.params.cache_salt
            prep.params = replace(prep.params, cache_salt=key_salt if salt is None else f"{key_salt}/{salt}")
        prep.key = getattr(request.state, "api_key", None)
        if prep.key is not None:
            prep.params = tenant_class(prep.key, prep.body.priority, prep.params)
            await self.charge(prep, getattr(request.state, "api_key_hold", None))
        request.state.trace.prepared(prep.marks)
        return prep

    async def charge(self, prep: _Prepared, hold: Hold | None) -> None:
        """Charges the request's tokens to its key's budget (gateway/limits.py): 429 naming it."""
        if hold is None:
            return
        try:
            await self.keys.limits.charge(hold, len(prep.prompt_ids) + prep.params.n * prep.params.max_tokens)
        except KeyLimitError as exc:
            self.metrics.api_key_requests.labels(hold.key.name, exc.outcome).inc()
            self.metrics.tenant(prep.params.priority, hold.key.name, "token_limited")
            raise

    def session_of(self, request: Request, body) -> str | None:
        """What names the request's session for the router (router/policy.py SessionAffinity): its
        SESSION_HEADER; with session_affinity "user", else the body's `user`; None: none, or "off"."""
        if self.session_affinity == "off":
            return None
        session = request.headers.get(SESSION_HEADER) or (body.user if self.session_affinity == "user" else None)
        return session[:MAX_SESSION_CHARS] if session else None

    def _prepare(self, raw: bytes, content_type: str | None, model) -> _Prepared:
        """Blocking: every check that can refuse the request (APIError, RequestValidationError) in the
        order a client would fix them, cheap ones before the prompt is tokenized."""
        start = time.time_ns()
        body = parse_body(model, raw, content_type)
        marks = [("parse", start, time.time_ns())]
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", param="model", code="model_not_found")
        shaping = None
        if isinstance(body, ChatCompletionRequest):
            prompt_ids, shaping = self.chat_prompt(body, marks)
        else:
            start = time.time_ns()
            prompt_ids = self.completion_prompt(body)
            marks.append(("tokenize", start, time.time_ns()))
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", param="prompt")
        self.check_ready()
        params = body.sampling_params(len(prompt_ids), self.max_model_len, self.tokenizer.vocab_size,
                                      self.max_prompt_tokens)
        if params.structured_output is not None:  # compiling a grammar may take a while
            self.check_structured_output(*params.structured_output)
        return _Prepared(body, prompt_ids, params, shaping, marks=marks)

    async def start(self, prep: _Prepared, kind: str, trace: RequestTrace) -> Generation:
        """Submits a prepared request to the router, returns the generation to stream or wait for. The
        router calls instances while placing, so it runs on a worker thread, not the event loop."""
        params, prompt_ids = prep.params, prep.prompt_ids
        rid = make_id("chatcmpl" if kind == "chat" else "cmpl")
        choices = []
        for i in range(params.n):
            output = prep.shaping() if prep.shaping else None
            keep = output is not None and output.keeps_special_tokens  # tool-call markers may be special tokens
            hidden = ({self.tokenizer.eos_token_id, *params.stop_token_ids} - {None}) if keep else ()
            text = TextState(self.tokenizer, prompt_ids, params.stop, params.min_tokens, not keep, frozenset(hidden))
            choices.append(Choice(i, text, None if params.logprobs is None else
                                  LogprobsFormatter(self.tokenizer, kind, params.logprobs), output))
        gen = Generation(self.cluster, rid, kind, prep.body.model, prompt_ids, choices, self.metrics,
                         asyncio.get_running_loop(), trace=trace, return_timings=self.return_timings)
        tenant = "" if prep.key is None else prep.key.name
        gen.tenant = (params.priority, tenant or NO_KEY)
        try:
            await asyncio.to_thread(self.cluster.submit, rid, prompt_ids, params, gen.listener, prep.session,
                                    trace.context, tenant, 1.0 if prep.key is None else prep.key.weight)
        except QueueFullError as exc:
            self.metrics.tenant(*gen.tenant, "queue_full")
            raise APIError(429, f"too many requests queued: {exc}", "rate_limit_exceeded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        self.metrics.tenant(*gen.tenant, "admitted")
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def respond(self, gen: Generation, body, request: Request):
        headers = gen.trace.headers()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.sse(include_usage), media_type="text/event-stream", headers=headers)
        answer = await gen.complete(request)
        if self.return_timings:
            headers["Server-Timing"] = server_timing(gen.timings)
        return JSONResponse(answer, headers=headers)


@dataclass
class _Prepared:
    """A request that passed every check: its body, prompt, sampling params and (chat) output shaping."""
    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    shaping: Callable[[], ChatOutput] | None
    session: str | None = None  # what names its session (x-session-id; `user`), set by `prepare`
    key: APIKey | None = None  # its API key (its class, weight and token budget), set by `prepare`
    marks: list = field(default_factory=list)  # the gateway's phases: (name, start, end) in time.time_ns()


def _add_generation_routes(app: FastAPI, gw: _Gateway) -> None:
    # The bodies are parsed off the event loop (`prepare`), not by FastAPI: the document declares them
    # (gateway/openapi.py). Key and limits: gateway/guard.py.
    # Each opens the request's trace first (gateway/trace.py): a refusal ends it with the error.
    @app.post("/v1/chat/completions", responses=openapi.GENERATION, openapi_extra=openapi.body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        with _traced(request, "/v1/chat/completions") as trace:
            prep = await gw.prepare(request, ChatCompletionRequest)
            gen = await gw.start(prep, "chat", trace)
        return await gw.respond(gen, prep.body, request)

    @app.post("/v1/completions", responses=openapi.GENERATION, openapi_extra=openapi.body(CompletionRequest))
    async def completions(request: Request):
        with _traced(request, "/v1/completions") as trace:
            prep = await gw.prepare(request, CompletionRequest)
            gen = await gw.start(prep, "completion", trace)
        return await gw.respond(gen, prep.body, request)


@contextmanager
def _traced(request: Request, route: str):
    """The request's trace, from its arrival until its generation starts; one refused on the way
    (APIError, a validation error) ends its span with the error."""
    trace = request.state.trace = RequestTrace(route, request.headers)
    try:
        yield trace
    except Exception as exc:
        trace.end({}, {"http.status_code": getattr(exc, "status", 422)}, error=str(exc)[:200])
        raise


def _add_service_routes(app: FastAPI, gw: _Gateway) -> None:
    @app.get("/v1/models", responses=openapi.KEYED)
    async def models():
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": now(),
                                            "owned_by": "pdserve", "max_model_len": gw.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses=openapi.NOT_READY)
    async def ready():
        gw.check_ready()
        return {"status": "ready"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
    async def metrics(request: Request):
        """Prometheus text, or OpenMetrics (which carries the phase histograms' exemplars: trace ids)
        to a scraper that asks for it (Accept: application/openmetrics-text)."""
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(openmetrics.generate_latest(gw.metrics.registry),
                            media_type=openmetrics.CONTENT_TYPE_LATEST)
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status():
        return {"instances": await asyncio.to_thread(gw.cluster.instance_status)}  # asks instances: off the loop


def create_app(cluster, tokenizer, model_name: str, max_model_len: int | None, api_key: str | None = None,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None, *,
               api_keys: Sequence[APIKey] = (), max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_prompt_tokens: int | None = None, session_affinity: str = "header",
               return_timings: bool = False, shared_limits: SharedLimits | None = None) -> FastAPI:
    """The gateway over a started `Cluster` or `Frontend` (anything with submit/abort/stop/ready/
    router/max_model_len and the typed view of router/view.py); `max_model_len` None: the cluster's,
    asked per request.
    `tool_call_parser` / `reasoning_parser`: names in gateway/tool_parsers.py and gateway/reasoning.py.
    `api_keys` (gateway/api_keys.py) and `api_key` (one more, unlimited, named "default"): the
    keys `/v1/...` takes (none: open); `max_request_bytes` bounds every body (413 past it);
    `max_prompt_tokens` bounds prompts below the context (400 past it); `session_affinity` (the spec's)
    what names a request's session for the router (SESSION_HEADER; "user": else the body's `user`);
    `return_timings`: each answer's usage carries its phase times (gateway/trace.py); `shared_limits`: the keys'
    limits held in Redis for every gateway (gateway/limit_scripts.py; None: each gateway its own)."""
    keys = [*api_keys, *configured_keys(api_key, None)]
    app = FastAPI(title="pdserve", version="0.1.0")
    gw = _Gateway(cluster, tokenizer, model_name, max_model_len, tool_call_parser, reasoning_parser,
                  max_prompt_tokens, session_affinity, return_timings)
    gw.metrics.add_api_keys([k.name for k in keys] or [NO_KEY])
    # (cluster/cli/serve.py replaces its keys in place when the keys file changes)
    app.state.api_keys = gw.keys = APIKeyManager(keys, shared=shared_limits, on_mode=gw.metrics.limits_mode)
    app.add_middleware(RequestGuard, keys=app.state.api_keys, metrics=gw.metrics, max_request_bytes=max_request_bytes)
    _install_error_handlers(app)
    _add_generation_routes(app, gw)
    _add_service_routes(app, gw)
    openapi.install(app, model_name)
    return app
