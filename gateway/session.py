"""One HTTP generation: router events in (on the event loop), OpenAI bodies or SSE chunks out.

Events come from the router's threads through `listener` (call_soon_threadsafe into an asyncio
queue), so hundreds of concurrent streams cost no threads. A client that goes away mid-request
aborts it on every instance (`cluster.abort`, on a worker thread: the event loop never waits on
the router), which frees its blocks: a stream notices when its next chunk cannot be sent, a
non-streaming request through a task that waits for the connection's `http.disconnect`.

Every request has a deadline, the cluster spec's `request_timeout_s` from its arrival (queueing
included): past it the request is aborted on its instances and the client gets 504 with an
OpenAI error body, or, on a stream, an error chunk and `[DONE]`; either way the response ends, so
the API key's slot is released (gateway/guard.py). Both ends come as sentinels in the request's
own event queue (one timer per request, nothing per token).

Text is decided here and nowhere else (engine/text/tokenizer.py): instances stream token ids; a stop string
found here ends the choice at once and stops it on its instances (`cluster.stop`).

`ChatOutput`: what a chat choice's text becomes: `reasoning_content` (the server's reasoning parser), `content`,
and tool calls (the request's tool choice), whole or as stream deltas. The reasoning parser runs
first; only its content reaches the tool parser (docs/tool_calls.md).

    tool choice   the output                                   read by
    auto          free; the model writes calls its own way      the server's tool-call parser
    required      constrained: [{"name", "parameters"}, ...]     tools.calls_from_required
    named         constrained: that function's arguments         tools.call_from_named
    none          free                                           nobody (all content)"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from engine.text.tokenizer import TextState
from gateway.logprobs import LogprobsFormatter
from gateway.metrics import REQUEST_PHASES
from gateway.protocol import APIError, now
from gateway.reasoning import ReasoningParser
from gateway.tool_parsers import NamedCallStream, ToolParser, required_stream
from gateway.tools import call_from_named, calls_from_required
from gateway.trace import RequestTrace
from router.flow import QUEUE_TIMEOUT
from router.tables import StreamEvent

RETRY_AFTER = {"Retry-After": "1"}
DISCONNECT_POLL_S = 0.5  # a server whose `receive` answers before the client leaves is asked this often
# what the generation puts in its own queue (told apart from the router's events by identity)
_DEADLINE = StreamEvent([], True, "deadline")
_CLIENT_GONE = StreamEvent([], True, "client_gone")


def request_timeout_s(cluster) -> float | None:
    """The deadline of a request on `cluster`: its spec's request_timeout_s (a Cluster or a
    Frontend); None (no deadline) for a stand-in without a spec."""
    return getattr(getattr(cluster, "spec", None), "request_timeout_s", None)


class Choice:
    """One of a request's n outputs: its text (stop strings cut), logprobs and end; a chat choice's
    `output` shapes the text into content, reasoning and tool calls (ChatOutput, below)."""

    def __init__(self, index: int, text: TextState, logprobs: LogprobsFormatter | None = None,
                 output: ChatOutput | None = None):
        self.index, self.text, self.logprobs, self.output = index, text, logprobs, output
        self.num_tokens = 0
        self.finished = self.stopped = False
        self.finish_reason: str | None = None

    def consume(self, event: StreamEvent) -> str:
        """Applies one event; returns the text that may be sent now. Tokens after a stop string are
        dropped (the choice ends with the token that completed it)."""
        if self.finished:
            return ""
        if event.token_ids:
            kept = len(event.token_ids) - self.text.feed(event.token_ids)
            self.num_tokens += kept
            if self.logprobs is not None:
                self.logprobs.add(event.token_ids[:kept], None if event.extras is None else
                                  [e["logprobs"] for e in event.extras[:kept]])
            self.stopped = self.text.stop is not None
        if event.finished or self.stopped:
            self.finished = True
            self.finish_reason = "stop" if self.stopped else event.finish_reason
        return self.text.take(self.finished)

    def take_logprobs(self) -> dict | None:
        return None if self.logprobs is None else self.logprobs.take()

    @property
    def reason(self) -> str | None:
        """The finish_reason the client sees ("tool_calls" where the model called tools)."""
        return self.output.finish_reason(self.finish_reason) if self.output else self.finish_reason

    def deltas(self, text: str) -> list[dict]:
        """A chat chunk's deltas for new text: content, or reasoning and tool call pieces."""
        if self.output is None:
            return [{"content": text}] if text else []
        return self.output.feed(text) + (self.output.finish() if self.finished else [])


class Generation:
    """One request's generation: n choices (one stream each from the router, events by index)."""

    def __init__(self, cluster, request_id: str, kind: str, model: str, prompt_ids: list[int], choices: list[Choice],
                 metrics, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None,
                 trace: RequestTrace | None = None, return_timings: bool = False):
        self.cluster = cluster  # submit, abort, stop (gateway/app.py: what the routes share)
        self.timeout_s = timeout_s if timeout_s is not None else request_timeout_s(cluster)  # None: no deadline
        self.request_id, self.kind, self.model, self.choices, self.metrics = request_id, kind, model, choices, metrics
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0  # of the prompt, served from a prefix cache (the latest attempt's)
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.listener = lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event)
        self.created, self.arrival_s = now(), time.monotonic()
        self.first_token_s = self.last_token_s = None
        self.error: str | None = None
        self.bad_request = False  # the error is the request's own (an instance refused it)
        self.timed_out = False  # its deadline passed: the error is a 504
        self.client_gone = False  # a non-streaming request's client closed its connection
        # its trace (gateway/trace.py), and its phases' seconds as the instances reported them with its end
        self.trace, self.return_timings, self.instance_timings = trace, return_timings, {}
        self.tenant: tuple[int, str] | None = None  # (its priority class, its key's name): per-tenant metrics
        self.num_preemptions = 0  # on its decode instances, as its end reports it

    @property
    def finished(self) -> bool:
        return self.error is not None or all(c.finished for c in self.choices)

    # -- events -----------------------------------------------------------------------------
    def _arm_deadline(self) -> asyncio.TimerHandle | None:
        """Puts _DEADLINE in the queue at arrival + timeout_s (at once if that has passed)."""
        if self.timeout_s is None:
            return None
        left = max(0.0, self.arrival_s + self.timeout_s - time.monotonic())
        return asyncio.get_running_loop().call_later(left, self.queue.put_nowait, _DEADLINE)

    async def _next(self) -> StreamEvent | None:
        """The router's next event; None when the request ends here instead: its deadline passed
        (`timed_out`, with the error set and counted) or its client left (`client_gone`)."""
        event = await self.queue.get()
        if event is _CLIENT_GONE:
            self.client_gone = True
            return None
        if event is _DEADLINE:
            if self.finished:  # (it came behind the last event: nothing to end)
                return None
            self.timed_out = True
            self.error = f"the request did not finish within its deadline of {self.timeout_s:g} s (request_timeout_s)"
            self.metrics.deadline_exceeded.labels(self.kind).inc()
            return None
        return event

    async def _watch_disconnect(self, request) -> None:
        """Puts _CLIENT_GONE in the queue once the client has closed its connection (nothing else
        reads it once the body is in: a non-streaming response sends only at the end)."""
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.queue.put_nowait(_CLIENT_GONE)

    def _consume(self, event: StreamEvent) -> tuple[Choice, str]:
        """Applies one event; returns its choice and the text that may be sent now."""
        if event.token_ids:
            t = time.monotonic()
            if self.first_token_s is None:
                self.first_token_s = t
                self.metrics.ttft.observe(t - self.arrival_s, self.exemplar)
            else:
                self.metrics.itl.observe(t - self.last_token_s)
            self.last_token_s = t
            self.metrics.generation_tokens.inc(len(event.token_ids))
        if event.num_cached_tokens is not None:  # a retry's prompt holds earlier output: capped at the prompt's
            self.num_cached_tokens = min(event.num_cached_tokens, self.num_prompt_tokens)
        choice = self.choices[event.index]
        stopped = choice.stopped
        text = choice.consume(event)
        if choice.stopped and not stopped:  # ends it on the instances too (from a worker thread)
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self.cluster.stop, self.request_id, choice.index, choice.num_tokens)
        if event.finished:
            self.instance_timings = self.instance_timings or event.timings or {}
            self.num_preemptions += event.num_preemptions
            self.error = self.error or event.error
            self.bad_request = self.bad_request or event.bad_request
            if self.finished:
                self.metrics.e2e.observe(time.monotonic() - self.arrival_s, self.exemplar)
        return choice, text

    def _abort(self) -> None:
        asyncio.get_running_loop().run_in_executor(None, self.cluster.abort, self.request_id)

    def _end(self) -> None:
        """Leaving before every choice ended (the client went away, or one choice failed): the rest
        are aborted on the instances, so their blocks are freed. The phase times are recorded."""
        if not all(c.finished for c in self.choices):
            self._abort()
            if self.error is None:
                self._account("cancelled")
        timings = self.timings
        for phase in REQUEST_PHASES:
            if (seconds := timings.get(phase)) is not None:
                self.metrics.phases.labels(phase).observe(seconds, self.exemplar)
        if self.tenant is not None:
            self.metrics.tenant_ended(*self.tenant, timings.get("queue"), self.num_preemptions,
                                      (self.error or "").startswith(QUEUE_TIMEOUT))
        if self.trace is not None:
            self.trace.end(timings, {"pdserve.request_id": self.request_id, **{
                f"gen_ai.usage.{k}": v for k, v in self.usage.items() if isinstance(v, int)}}, self.error)

    @property
    def exemplar(self) -> dict[str, str] | None:
        """What a latency histogram's observation of it carries: its trace id, when it is traced."""
        trace_id = self.trace.trace_id if self.trace is not None else ""
        return {"trace_id": trace_id} if trace_id else None

    @property
    def timings(self) -> dict[str, float]:
        """Its phases' seconds so far: the gateway's prepare, the router's and instances' (router/tables.py
        PHASES), then time to first token and end to end (from its submission)."""
        prepare = None if self.trace is None else self.trace.prepare_s
        out = {**({"prepare": prepare} if prepare is not None else {}), **self.instance_timings}
        if self.first_token_s is not None:
            out["ttft"] = self.first_token_s - self.arrival_s
        out["e2e"] = (self.last_token_s or time.monotonic()) - self.arrival_s
        return out

    def _account(self, status: str) -> None:
        self.metrics.requests.labels(self.kind, status).inc()

    def _failed(self) -> APIError:
        """The error the client gets (and its count): 400 (its own), 504 (its deadline) or 503."""
        self._account("timeout" if self.timed_out else "error")
        if self.bad_request:
            return APIError(400, self.error)
        if self.timed_out:
            return APIError(504, self.error, "timeout_error", code="request_timeout")
        return APIError(503, f"generation failed: {self.error}", "service_unavailable", headers=RETRY_AFTER)

    @property
    def usage(self) -> dict:
        """The prompt counts once, however many choices it has (it was prefilled once); its tokens
        served from a prefix cache are OpenAI's `prompt_tokens_details.cached_tokens`."""
        completion = sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.num_prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}
        if self.return_timings:  # milliseconds (return_timings: gateway/trace.py)
            usage["timings"] = {k: round(v * 1000, 3) for k, v in self.timings.items()}
        return usage

    def _head(self, object_: str) -> dict:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model}

    # -- non-streaming ----------------------------------------------------------------------
    async def complete(self, request) -> dict:
        """The whole answer, or APIError; {} for a client that left (nobody reads it)."""
        parts: list[list[str]] = [[] for _ in self.choices]
        deadline, watcher = self._arm_deadline(), asyncio.ensure_future(self._watch_disconnect(request))
        try:
            while not self.finished and (event := await self._next()) is not None:
                choice, text = self._consume(event)
                parts[choice.index].append(text)
        finally:
            watcher.cancel()
            if deadline is not None:
                deadline.cancel()
            self._end()  # aborts what has not finished (the client left, the deadline passed)
        if self.client_gone and self.error is None:
            return {}
        if self.error:
            raise self._failed()
        self._account("ok")
        choices = [self._final(c, "".join(p)) for c, p in zip(self.choices, parts)]
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": self.usage}

    def _final(self, c: Choice, text: str) -> dict:
        if self.kind == "chat":
            message = c.output.message(text) if c.output else {"content": text}
            return {"index": c.index, "message": {"role": "assistant", **message},
                    "logprobs": c.take_logprobs(), "finish_reason": c.reason}
        return {"index": c.index, "text": text, "logprobs": c.take_logprobs(), "finish_reason": c.finish_reason}

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, c: Choice, text: str | None, finish_reason: str | None, include_usage: bool,
               role: bool = False, delta: dict | None = None) -> str:
        """One SSE chunk; it carries the logprobs of every token the choice received since its last."""
        logprobs = None if role else c.take_logprobs()
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (delta or {})
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def _chunks(self, c: Choice, text: str, include_usage: bool) -> list[str]:
        """The chunks new text makes; the choice's last one carries its finish_reason."""
        end = c.reason if c.finished else None
        if self.kind != "chat":
            return [self._chunk(c, text, end, include_usage)] if text or c.finished else []
        deltas = c.deltas(text)
        if c.finished and not deltas:
            deltas = [{}]
        return [self._chunk(c, None, end if i == len(deltas) - 1 else None, include_usage, delta=d)
                for i, d in enumerate(deltas)]

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        deadline = self._arm_deadline()
        try:
            if self.kind == "chat":
                for c in self.choices:
                    yield self._chunk(c, None, None, include_usage, role=True)
            while not self.finished:
                event = await self._next()  # None: the deadline passed (the error is set)
                choice, text = self._consume(event) if event is not None else (None, "")
                if self.error:
                    yield f"data: {json.dumps(self._failed().body())}\n\n"
                    break
                for chunk in self._chunks(choice, text, include_usage):
                    yield chunk
            else:
                self._account("ok")
                if include_usage:
                    obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
                    yield f"data: {json.dumps({**self._head(obj), 'choices': [], 'usage': self.usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if deadline is not None:
                deadline.cancel()
            self._end()  # the client may have disconnected (the generator was cancelled)


class ChatOutput:
    """One choice's shaping. `mode`: None (no tools), "auto", "required" or "named" (`name` the function)."""

    def __init__(self, reasoning: ReasoningParser | None = None, in_reasoning: bool = False, mode: str | None = None,
                 tool_parser: ToolParser | None = None, name: str | None = None):
        self.reasoning, self.in_reasoning = reasoning, in_reasoning
        self.mode, self.tool_parser, self.name = mode, tool_parser, name
        self._reasoning_stream = reasoning.stream(in_reasoning=in_reasoning) if reasoning else None
        self._tools_stream = None
        if mode == "auto":
            self._tools_stream = tool_parser.stream()
        elif mode == "required":
            self._tools_stream = required_stream()
        elif mode == "named":
            self._tools_stream = NamedCallStream(name)
        self.called = False  # a tool call went out (finish_reason "tool_calls")

    @property
    def keeps_special_tokens(self) -> bool:
        """An auto tool parser reads markers that may be special tokens (<tool_call>, [TOOL_CALLS]), and
        a reasoning parser may (gpt-oss's harmony channels)."""
        return (self.mode == "auto" and not self.tool_parser.skip_special_tokens
                or self.reasoning is not None and self.reasoning.keeps_special_tokens)

    # -- streamed -------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        """Chunk deltas for new text (maybe none: a parser may hold text back)."""
        if self._reasoning_stream is None:
            return self._content(text)
        return self._split(*self._reasoning_stream.feed(text))

    def finish(self) -> list[dict]:
        """The deltas held back until the end."""
        deltas = self._split(*self._reasoning_stream.finish()) if self._reasoning_stream else []
        if self._tools_stream is not None:
            deltas += self._note(self._tools_stream.finish())
        return deltas

    def _split(self, reasoning: str | None, content: str | None) -> list[dict]:
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        return deltas + (self._content(content) if content else [])

    def _content(self, text: str) -> list[dict]:
        if self._tools_stream is None:
            return [{"content": text}] if text else []
        return self._note(self._tools_stream.feed(text))

    def _note(self, deltas: list[dict]) -> list[dict]:
        self.called = self.called or any("tool_calls" in d for d in deltas)
        return deltas

    # -- whole ----------------------------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """The assistant message's fields for a whole output: content, and reasoning_content and
        tool_calls where there are any. A constrained output cut short (max_tokens) stays content."""
        reasoning, content = (None, text or None)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text, in_reasoning=self.in_reasoning)
        calls = []
        if self.mode == "auto":
            content, calls = self.tool_parser.parse(content or "")
        elif self.mode in ("required", "named"):
            try:
                calls = (calls_from_required(content or "") if self.mode == "required"
                         else [call_from_named(self.name, content or "")])
                content = None
            except ValueError:
                calls = []
        self.called = bool(calls)
        out = {"content": content}
        if self.reasoning is not None:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = [c.to_openai() for c in calls]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" where the model called tools of its own choice or as required; a
        named function's call ends with "stop"."""
        return "tool_calls" if self.called and reason == "stop" and self.mode in ("auto", "required") else reason
