"""A gateway that stops without cutting anyone off: on SIGTERM it drains.

    SIGTERM ─> readiness 503 ("draining"), new /v1 requests 503 (uvicorn closes the listener too)
            ─> running requests go on, up to `timeout_s`
            ─> then each one still running ends explicitly:
                 a stream:      data: {"error": {..., "code": "server_shutting_down"}}  then  data: [DONE]
                 not started:   503 with the OpenAI error body (and Retry-After)
            ─> the process exits (uvicorn waits for the connections, `grace_s`, then stops)

openai-python raises `APIError` on a stream chunk that carries `error` (openai/_streaming.py), and
retries a 503 on its own, so a client always sees either its whole answer or an error it can act on;
never a stream that just stops. A request whose JSON body was already being sent goes on (it is
one write). An ended generation is cancelled like one whose client left (gateway/session.py), so its
instances abort it and free its blocks, and the API key's slot is released (gateway/guard.py).

A pure ASGI middleware (outermost: outside the key check, so a cancelled request still releases
its slot on its way out), wired by cluster/cli/serve.py, which also hooks uvicorn's signal handler.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

from fastapi.responses import JSONResponse

from gateway.guard import API_PREFIX
from gateway.protocol import APIError

logger = logging.getLogger(__name__)
DEFAULT_DRAIN_TIMEOUT_S = 30.0
SHUTDOWN_MARGIN_S = 5.0  # after the bound: the error chunks are written and the connections close
ERROR_CODE = "server_shutting_down"


def _shutting_down(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code=ERROR_CODE,
                    headers={"Retry-After": "1", "Connection": "close"})


class _Response:
    """One /v1 request's response as it goes out: whether it started, is a stream, ended. Every
    send holds `lock`, so a cut never lands between two halves of a message."""

    def __init__(self, send):
        self.raw_send, self.lock = send, asyncio.Lock()
        self.started = self.streaming = self.ended = self.cut = False
        self.task: asyncio.Task | None = None

    async def send(self, message: dict) -> None:
        async with self.lock:
            if self.cut:  # the app was cancelled; nothing more of it goes out
                return
            if message["type"] == "http.response.start":
                self.started = True
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                self.streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.ended = True
            await self.raw_send(message)

    @property
    def cuttable(self) -> bool:
        """Not ended, and either a stream or not started (a started plain body is one write: it ends)."""
        return not self.ended and (self.streaming or not self.started)


class Drain:
    """ASGI middleware that drains the gateway once `begin()` is called (SIGTERM).

    Properties: before `begin()` it only passes requests through (one lock per send). After it,
    `/ready` and new `/v1` requests get 503 at once; `/health`, `/metrics` and `/status` still
    answer (liveness must not fail while draining). Requests running at `begin()` run on until
    `timeout_s` after it; each one still running then is ended explicitly (module docstring),
    never by closing its connection. `timeout_s` 0: they are ended at once.
    """

    def __init__(self, app, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S):
        assert timeout_s >= 0, timeout_s
        self.app, self.timeout_s = app, timeout_s
        self.draining = False
        self.began_s: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: set[_Response] = set()

    @property
    def grace_s(self) -> float:
        """How long the server may wait for connections after SIGTERM: the bound plus a margin."""
        return self.timeout_s + SHUTDOWN_MARGIN_S

    def attach(self, server) -> None:
        """Makes a `uvicorn.Server`'s SIGTERM/SIGINT handler begin the drain first; a second
        SIGINT (Ctrl-C again) ends what still runs at once, as the bound would."""
        handle_exit = server.handle_exit

        def draining_exit(sig, frame) -> None:
            if self.draining and sig == signal.SIGINT and self._loop is not None:
                self._loop.call_soon_threadsafe(self._expire)
            self.begin()
            handle_exit(sig, frame)
        server.handle_exit = draining_exit  # capture_signals() installs self.handle_exit when it runs

    def begin(self) -> None:
        """Starts the drain (idempotent). Safe in a signal handler: sets flags, then hands the
        rest (logging, the timer) to the event loop."""
        if self.draining:
            return
        self.draining, self.began_s = True, time.monotonic()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_timer)

    def _start_timer(self) -> None:
        logger.info("draining: %d requests running may take up to %.0f s; new ones get 503",
                    len(self._running), self.timeout_s)
        self._loop.call_later(max(0.0, self.began_s + self.timeout_s - time.monotonic()), self._expire)

    def _expire(self) -> None:
        cut = [r for r in self._running if r.cuttable]
        if cut:
            logger.warning("drain bound (%.0f s) reached: ending %d requests with an error", self.timeout_s, len(cut))
        for response in cut:
            self._loop.create_task(self._cut(response))

    @staticmethod
    async def _cut(response: _Response) -> None:
        async with response.lock:  # not in the middle of one of the app's sends
            if response.cuttable and response.task is not None:
                response.cut = True
                response.task.cancel()

    async def __call__(self, scope, receive, send) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif self.draining and (scope["path"] == "/ready" or scope["path"].startswith(API_PREFIX)):
            await _respond(_shutting_down("this gateway is shutting down (draining): send the request to another one"),
                           scope, receive, send)
        elif scope["path"].startswith(API_PREFIX):
            await self._run(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _run(self, scope, receive, send) -> None:
        """Runs one /v1 request in a task of its own, which `_expire` may cancel."""
        response = _Response(send)
        response.task = asyncio.get_running_loop().create_task(self.app(scope, receive, response.send))
        self._running.add(response)
        try:
            await response.task  # a cancel of this request (uvicorn's, the client's) reaches the task too
        except asyncio.CancelledError:
            if not response.cut:
                raise
            await self._end(response, scope, receive, send)
        finally:
            self._running.discard(response)

    async def _end(self, response: _Response, scope, receive, send) -> None:
        """The explicit end of a request the bound cut: an error chunk and [DONE], or a 503."""
        error = _shutting_down(f"the gateway is shutting down and its drain bound ({self.timeout_s:g} s) ended "
                               "this generation before it finished: retry the request")
        if response.streaming:
            body = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await _respond(error, scope, receive, send)
        response.ended = True


async def _respond(exc: APIError, scope, receive, send) -> None:
    await JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(scope, receive, send)
