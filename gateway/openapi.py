"""What the gateway's OpenAPI document declares beyond FastAPI's defaults, so that it tells the
truth: every status a route answers with its OpenAI-style error body (and `Retry-After` where it
is sent), the streamed content type beside JSON, `/metrics` as Prometheus text, and `model` as
the one served name (a client or a fuzzer that reads the document asks for a model that exists).
The generation routes parse their own bodies (off the event loop, gateway/app.py), so the request
bodies are declared here (`body`), with the schemas FastAPI would have derived."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import OpenAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.protocol import ChatCompletionRequest, CompletionRequest

REQUEST_BODIES = (ChatCompletionRequest, CompletionRequest)  # what `body` may name
_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the gateway answers: `{"error": {message, type, param, code}}`."""
    error: ErrorDetail


_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}


def _error(description: str, retry: bool = False) -> dict:
    return {"model": ErrorResponse, "description": description, **({"headers": _RETRY} if retry else {})}


UNAUTHORIZED = {401: _error("missing or wrong API key, when the server has one")}
# gateway/guard.py: every /v1 route
KEY_LIMITED = {429: _error("the API key's rate or concurrency limit (type `requests`, code `rate_limit_exceeded`)",
                           retry=True)}
KEYED = {**UNAUTHORIZED, **KEY_LIMITED}
NOT_READY = {503: _error("no ready instance (or every retry failed)", retry=True)}
GENERATION = {
    200: {"description": "the completion (JSON), or with `stream` its chunks (server-sent events)",
          "content": {"text/event-stream": {}}},
    400: _error("a value the server cannot serve: a prompt over the context or --max-prompt-tokens, a count "
                "past its bound (stop, stop_token_ids, logit_bias, tools), "
                "max_tokens out of range, an unsupported parameter, ..."),
    **UNAUTHORIZED,
    404: _error("another model than the one served"),
    413: _error("the body is over the server's bound (--max-request-bytes)"),
    422: _error("the body does not parse or validate"),
    429: _error("the router's queue is full, or the API key's rate or concurrency limit", retry=True),
    **NOT_READY,
}
METRICS = {200: {"description": "Prometheus text exposition",
                 "content": {"text/plain": {"schema": {"type": "string"}}}}}


def body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its required JSON body is `model` (one of REQUEST_BODIES)."""
    assert model in REQUEST_BODIES, model
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app: FastAPI, model_name: str) -> None:
    """Makes `app.openapi()` hold the request bodies' schemas, and give `model` as an enum of the
    served name in every request body."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_BODIES], ref_template=_REF)
            schema["components"]["schemas"].update(defs["$defs"])
            schema = jsonable_encoder(OpenAPI.model_validate(schema), by_alias=True, exclude_none=True)  # as FastAPI's
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
