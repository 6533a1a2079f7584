"""The gateway's front door: a pure ASGI middleware ahead of FastAPI that bounds every request body
and, on the API (`/v1/...`), checks the API key and applies the key's limits (`APIKeyManager`: who a
request is, its key's token bucket and requests in flight; the keys themselves, their file and its
watcher: api_keys.py).

Pure ASGI rather than a FastAPI dependency for two reasons. The body bound must hold before
anything parses the body: a Content-Length over it is answered 413 unread, and a chunked body is
counted as it arrives and answered 413 the moment it passes the bound (nothing of it is kept). And
a key's request stays in flight until its response has been sent in full: `await app(...)`
returns only when the last chunk of a stream is out, or the client went away (uvicorn's
`http.disconnect` cancels the stream), or the app raised, so the `finally` that releases the
slot covers every way a request ends, whatever the route does.

Probes (`/health`, `/ready`), `/metrics` and the OpenAPI document need no key; `/status` needs one where
keys are configured (it shows rank addresses and pids), without the key's limits. None of them takes
a body: a request outside `/v1` that announces one is answered 413 before a byte of it is read.
The presented key is hashed and dropped here; only its name travels on (`request.state.api_key_name`).
"""
from __future__ import annotations

import hmac
import logging
import time
from typing import Callable, Iterable

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from gateway.api_keys import NO_KEY, APIKey, check_unique_keys, hash_api_key
from gateway.limits import Hold, KeyLimitError, KeyLimits
from gateway.metrics import GatewayMetrics
from gateway.protocol import APIError

logger = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
API_PREFIX = "/v1/"  # what needs a key: the OpenAI routes
STATUS_PATH = "/status"  # needs a key too (rank addresses and pids), without the key's limits


class APIKeyManager:
    """Who a request is, and its key's limits (gateway/limits.py KeyLimits: in Redis, shared by every
    gateway, when `shared` is given; else in this process). `replace` may come from another thread
    (KeysFileWatcher): the keys are one tuple, swapped whole."""

    def __init__(self, keys: Iterable[APIKey], clock: Callable[[], float] = time.monotonic, shared=None,
                 on_mode: Callable[[bool, bool], None] = lambda shared, configured: None):
        self.limits = KeyLimits(shared, clock, on_mode)
        self.keys: tuple[APIKey, ...] = ()
        self.replace(keys)

    def replace(self, keys: Iterable[APIKey]) -> None:
        """Puts `keys` in place of the current ones in one step (ValueError for a duplicate name or
        hash: nothing changes). A key that keeps its name and rate keeps its bucket, so a reload
        refills no one; requests in flight stay counted under their key until they end."""
        keys = tuple(keys)
        check_unique_keys(keys)
        self.limits.local.replace(keys)
        self.keys = keys

    @property
    def required(self) -> bool:
        """Whether requests must present a key (any is configured)."""
        return bool(self.keys)

    def identify(self, authorization: str | None) -> APIKey | None:
        """The key an `Authorization: Bearer <key>` header presents; None: none, or a wrong one.
        Every stored hash is compared (constant time), so timing tells nothing of which matched."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hash_api_key(token.strip()).encode()
        found = None
        for key in self.keys:  # one snapshot: a replace meanwhile does not change what is compared
            if hmac.compare_digest(digest, key.sha256.encode()):
                found = key
        return found

    async def admit(self, key: APIKey) -> Hold:
        """Counts a new request of `key` in flight; `release` its hold when its response ends.

        Raises:
            KeyLimitError (429): its concurrency limit is reached (Retry-After 1: a slot frees when a
                request ends, which cannot be foreseen) or its bucket is empty (Retry-After: the
                whole seconds until a token is there). A refused request takes nothing.
        """
        return await self.limits.admit(key)

    async def release(self, hold: Hold) -> None:
        await self.limits.release(hold)


class RequestGuard:
    """ASGI middleware: body bound everywhere; key, limits and per-key metrics on `/v1/...`."""

    def __init__(self, app, keys: APIKeyManager, metrics: GatewayMetrics, max_request_bytes: int):
        assert max_request_bytes >= 1, max_request_bytes
        self.app, self.keys, self.metrics, self.max_request_bytes = app, keys, metrics, max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not scope["path"].startswith(API_PREFIX):
            await self._outside_api(scope, receive, send)
            return
        key = self.keys.identify(_header(scope, b"authorization"))
        if key is None and self.keys.required:
            await self._unauthorized(scope, receive, send)
            return
        name = NO_KEY if key is None else key.name
        scope.setdefault("state", {})["api_key_name"] = name  # request.state.api_key_name in the routes
        scope["state"]["api_key"] = key  # its class, weight and token budget (gateway/app.py)
        scope["state"]["api_key_cache_salt"] = None if key is None else key.cache_salt  # (isolate_cache)
        hold = None
        try:
            self._check_length(scope)
            if key is not None:
                hold = await self.keys.admit(key)
        except KeyLimitError as exc:
            self._count(name, exc.outcome)
            logger.debug("API key %s %s: %s %s", name, exc.outcome, scope["method"], scope["path"])
            await _respond(exc, scope, receive, send)
            return
        except APIError as exc:
            self._count(name, "too_large" if exc.status == 413 else "bad_request")
            await _respond(exc, scope, receive, send)
            return
        scope["state"]["api_key_hold"] = hold  # its token budget is charged to it (gateway/app.py)
        await self._in_flight(scope, receive, send, hold, name)

    async def _outside_api(self, scope, receive, send) -> None:
        """Probes, /metrics, /status and the document take no body: one announced (a Content-Length
        over 0, or chunked) is refused at once, unread, and the connection closed."""
        declared = _header(scope, b"content-length")
        if _header(scope, b"transfer-encoding") is not None or declared not in (None, "0"):
            await _respond(APIError(413, f"{scope['path']} takes no request body", code="request_too_large",
                                    headers={"Connection": "close"}), scope, receive, send)
            return
        if scope["path"] == STATUS_PATH and self.keys.required \
                and self.keys.identify(_header(scope, b"authorization")) is None:
            await self._unauthorized(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _unauthorized(self, scope, receive, send) -> None:
        """401 for a missing or wrong key, counted under no key's name."""
        self._count(NO_KEY, "unauthorized")
        logger.debug("no or wrong API key: %s %s", scope["method"], scope["path"])
        await _respond(APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                "authentication_error", code="invalid_api_key"), scope, receive, send)

    async def _in_flight(self, scope, receive, send, hold: Hold | None, name: str) -> None:
        """Runs an admitted request; its slot is held until its response ended, however it ended."""
        gauge = self.metrics.api_key_in_flight.labels(name)
        gauge.inc()
        try:
            await self._pass(scope, receive, send, name)
        finally:
            gauge.dec()
            if hold is not None:
                await self.keys.release(hold)

    def _check_length(self, scope) -> None:
        """APIError(413) for a declared body over the bound, before a byte of it is read."""
        declared = _header(scope, b"content-length")
        if declared is None:
            return
        if not declared.isdigit():
            raise APIError(400, f"invalid Content-Length {declared[:40]!r}", code="invalid_content_length")
        if int(declared) > self.max_request_bytes:
            raise self._too_large()

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_request_bytes} bytes, this server's bound "
                             "(--max-request-bytes)", code="request_too_large")

    async def _pass(self, scope, receive, send, name: str) -> None:
        """Reads the body up to the bound (413 past it) and hands the request on with it, counted for
        key `name`."""
        try:
            body = await self._read_body(receive)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return
        if body is None:
            self._count(name, "too_large")
            await _respond(self._too_large(), scope, receive, send)
            return
        self._count(name, "served")
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None as soon as it passes the bound (the rest is never read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _count(self, name: str, outcome: str) -> None:
        self.metrics.api_key_requests.labels(name, outcome).inc()


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive):
    """A `receive` that gives the buffered body once, then the client's own messages (a
    disconnect, which a stream and `request.is_disconnected()` listen for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


async def _respond(exc: APIError, scope, receive, send) -> None:
    await JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(scope, receive, send)
