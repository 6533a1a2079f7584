"""Turns new tokens into text: incremental detokenization and stop strings.

The text a request has emitted lags the detokenized text by `len(longest stop string) - 1`
characters, so a stop string split across tokens is never half-streamed to the client.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    num_output_tokens: int = 0  # after these tokens; lets a consumer drop tokens it already has
    error: str | None = None
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, when the request asked
    kv_load_failed: bool = False  # the error is a failed KV transfer (the router may recompute here)


class TextState:
    """One request's output text: incremental detokenization, stop strings, hold-back. Used by
    the decode worker (to stop generation) and by the gateway (to stream text)."""

    def __init__(self, tokenizer: Tokenizer | None, req: Request, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, skip_special_tokens) if tokenizer else None
        self.stops = req.sampling_params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # detokenized output, cut at a stop string
        self.num_emitted_chars = 0
        self.num_seen_tokens = 0
        self.min_tokens, self.num_fed = req.sampling_params.min_tokens, 0

    def feed(self, token_ids: list[int]) -> str | None:
        """Adds new tokens; returns the stop string found, if any (the text is cut before it). Stop
        strings count once the output has `min_tokens` tokens (vLLM's rule), in the text then added."""
        if self.detok is None:
            return None
        before = len(self.text)
        self.text += self.detok.step(token_ids)
        self.num_fed += len(token_ids)
        if self.num_fed < self.min_tokens:
            return None
        for stop in self.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                return stop
        return None

    def take(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold)
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def add_request(self, req: Request) -> None:
        if req.sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        self.states[req.request_id] = TextState(self.tokenizer, req)

    def fork(self, parent_id: str, children: list[Request]) -> None:
        """A request became its n choices (Scheduler._fork): each streams its own text."""
        self.states.pop(parent_id, None)
        for child in children:
            self.add_request(child)

    def text(self, request_id: str) -> str:
        return self.states[request_id].text

    def process(self, reqs: list[Request]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of this step and the ids of requests that hit a stop string."""
        outputs, stopped = [], []
        for req in reqs:
            st = self.states[req.request_id]
            new_ids = req.output_token_ids[st.num_seen_tokens:]
            logprobs = None
            if req.sampling_params.logprobs is not None:
                logprobs = req.output_logprobs[st.num_seen_tokens:]
                assert len(logprobs) == len(new_ids), (req.request_id, len(logprobs), len(new_ids))
            st.num_seen_tokens = req.num_output_tokens
            stop = st.feed(new_ids)
            finished = req.is_finished or stop is not None
            if stop is not None:
                req.stop_reason = stop
                if not req.is_finished:
                    stopped.append(req.request_id)
            reason = "stop" if stop is not None else req.status.finish_reason
            outputs.append(RequestOutput(req.request_id, new_ids, st.take(finished), finished, reason,
                                         req.num_output_tokens, new_logprobs=logprobs))
            if finished:
                del self.states[req.request_id]
        return outputs, stopped

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
