"""One HTTP generation: router events in (on the event loop), OpenAI bodies or SSE chunks out.

Events come from the router's threads through `listener` (call_soon_threadsafe into an asyncio
queue), so hundreds of concurrent streams cost no threads. A client that goes away mid-request
aborts it on every instance (`cluster.abort`, on a worker thread: the event loop never waits on
the router), which frees its blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from decode_worker.output import TextState
from gateway.logprobs import LogprobsFormatter
from gateway.protocol import APIError, now
from router.stream import StreamEvent

RETRY_AFTER = {"Retry-After": "1"}


class Generation:
    def __init__(self, request_id: str, kind: str, model: str, prompt_ids: list[int], text: TextState, metrics,
                 loop: asyncio.AbstractEventLoop, logprobs: LogprobsFormatter | None = None):
        self.request_id, self.kind, self.model, self.text, self.metrics = request_id, kind, model, text, metrics
        self.logprobs = logprobs
        self.num_prompt_tokens = len(prompt_ids)
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.listener = lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event)
        self.num_tokens, self.created, self.arrival_s = 0, now(), time.monotonic()
        self.first_token_s = self.last_token_s = None
        self.finished = self.stopped = False
        self.finish_reason: str | None = None
        self.error: str | None = None

    # -- events -----------------------------------------------------------------------------
    def _consume(self, event: StreamEvent) -> str:
        """Applies one event; returns the text that may be sent now."""
        if event.token_ids:
            t = time.monotonic()
            if self.first_token_s is None:
                self.first_token_s = t
                self.metrics.ttft.observe(t - self.arrival_s)
            else:
                self.metrics.itl.observe(t - self.last_token_s)
            self.last_token_s = t
            self.num_tokens += len(event.token_ids)
            self.metrics.generation_tokens.inc(len(event.token_ids))
            if not self.stopped:
                if self.logprobs is not None:
                    self.logprobs.add(event.token_ids, event.logprobs)
                if self.text.feed(event.token_ids) is not None:
                    self.stopped = True  # the decode worker stops too; text after the stop is dropped
        if event.finished:
            self.finished, self.error = True, event.error
            self.finish_reason = "stop" if self.stopped else event.finish_reason
            self.metrics.e2e.observe(time.monotonic() - self.arrival_s)
        return self.text.take(self.finished)

    def _abort(self, cluster) -> None:
        asyncio.get_running_loop().run_in_executor(None, cluster.abort, self.request_id)

    def _account(self, status: str) -> None:
        self.metrics.requests.labels(self.kind, status).inc()

    def _failed(self) -> APIError:
        return APIError(503, f"generation failed: {self.error}", "service_unavailable", headers=RETRY_AFTER)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

    def _head(self, object_: str) -> dict:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model}

    # -- non-streaming ----------------------------------------------------------------------
    async def complete(self, cluster, request) -> dict:
        parts = []
        try:
            while not self.finished:
                try:
                    event = await asyncio.wait_for(self.queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return {}
                    continue
                parts.append(self._consume(event))
        finally:
            if not self.finished:
                self._abort(cluster)
                self._account("cancelled")
        if self.error:
            self._account("error")
            raise self._failed()
        self._account("ok")
        text = "".join(parts)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self._take_logprobs(),
                      "finish_reason": self.finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage}
        choice = {"index": 0, "text": text, "logprobs": self._take_logprobs(), "finish_reason": self.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage}

    def _take_logprobs(self) -> dict | None:
        return None if self.logprobs is None else self.logprobs.take()

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, text: str | None, finish_reason: str | None, include_usage: bool, role: bool = False) -> str:
        """One SSE chunk; it carries the logprobs of every token received since the last chunk."""
        logprobs = None if role else self._take_logprobs()
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def sse(self, cluster, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.kind == "chat":
                yield self._chunk(None, None, include_usage, role=True)
            while not self.finished:
                text = self._consume(await self.queue.get())
                if self.error:
                    self._account("error")
                    yield f"data: {json.dumps(self._failed().body())}\n\n"
                    break
                if text or self.finished:
                    yield self._chunk(text, self.finish_reason if self.finished else None, include_usage)
            else:
                self._account("ok")
                if include_usage:
                    obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
                    yield f"data: {json.dumps({**self._head(obj), 'choices': [], 'usage': self.usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not self.finished:  # the client disconnected (the generator was cancelled)
                self._abort(cluster)
                self._account("cancelled")
