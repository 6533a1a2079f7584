"""The OpenAI-compatible HTTP gateway (FastAPI). Tokenizes once here, sends token ids through
the router, detokenizes the streamed tokens incrementally (stop strings cut here too).

    POST /v1/chat/completions, /v1/completions   (stream or not)
    GET  /v1/models, /health, /ready, /metrics, /status
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from decode_worker.output import TextState
from engine.request import Request as EngineRequest
from gateway.metrics import GatewayMetrics
from gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest, make_id, now
from gateway.session import Generation
from router.router import QueueFullError

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


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
    async def internal_error(_, exc: Exception):
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", "internal_error"))


def create_app(cluster, tokenizer, model_name: str, max_model_len: int, api_key: str | None = None) -> FastAPI:
    """The gateway over a started `Cluster` (anything with submit/abort/ready/instances/router)."""
    app = FastAPI(title="pdserve", version="0.1.0")
    metrics = GatewayMetrics(cluster)
    _install_error_handlers(app)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not (auth.startswith("Bearer ") and secrets.compare_digest(auth[7:], api_key)):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                           code="invalid_api_key")

    def check_model(model: str) -> None:
        if model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def start(body, prompt_ids: list[int], kind: str) -> Generation:
        check_model(body.model)
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        params = body.sampling_params(len(prompt_ids), max_model_len)
        if not cluster.ready():
            raise APIError(503, "no instance is ready to serve", "service_unavailable",
                           headers={"Retry-After": RETRY_AFTER_S})
        rid = make_id("chatcmpl" if kind == "chat" else "cmpl")
        text = TextState(tokenizer, EngineRequest(rid, prompt_ids, params))
        gen = Generation(rid, kind, body.model, prompt_ids, text, metrics, asyncio.get_running_loop())
        try:
            cluster.submit(rid, prompt_ids, params, listener=gen.listener)
        except QueueFullError as exc:
            raise APIError(429, f"too many requests queued: {exc}", "rate_limit_exceeded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def respond(gen: Generation, body, request: Request):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.sse(cluster, include_usage), media_type="text/event-stream")
        return JSONResponse(await gen.complete(cluster, request))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        gen = start(body, tokenizer.encode_chat(messages), "chat")
        return await respond(gen, body, request)

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        gen = start(body, ids, "completion")
        return await respond(gen, body, request)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "pdserve", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not cluster.ready():
            raise APIError(503, "not ready: need a healthy decode instance (and prefill, disaggregated)",
                           "service_unavailable", headers={"Retry-After": RETRY_AFTER_S})
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status():
        return {"instances": [{"instance_id": i.instance_id, "role": i.role, "tp_size": i.tp_size,
                               "healthy": i.client.info.healthy, "load": i.client.info.load}
                              for i in list(cluster.instances.values())]}

    return app
