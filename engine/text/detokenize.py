"""A request's output text: incremental detokenization, stop strings, hold-back.

Text is decided in one place per serving path: the gateway for served requests (gateway/session.py),
the offline `LLM` for `pdserve generate` (decode_worker/llm.py). Workers and the router move token ids
and logprobs only; a stop string found here ends the request there (docs/architecture.md, "Text once").

The text a request has emitted lags the detokenized text by `len(longest stop string) - 1` characters,
so a stop string split across tokens is never half-streamed to the client.
"""
from __future__ import annotations

from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer


class TextState:
    """One output's text. `feed` tokens as they come; `take` the text that may be sent now."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 min_tokens: int = 0, skip_special_tokens: bool = True, hidden: frozenset[int] = frozenset()):
        """`hidden`: tokens that count but add no text (EOS and stop ids, where special tokens are kept
        for a tool-call parser)."""
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.hidden = hidden
        self.stops, self.min_tokens = stop, min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # detokenized output, cut at a stop string
        self.num_emitted_chars = 0
        self.num_tokens = 0  # tokens fed, up to and including the one that completed a stop string
        self.stop: str | None = None  # the stop string found; nothing is added after it

    def feed(self, token_ids: list[int]) -> int:
        """Adds new tokens, one at a time, until a stop string completes (the text is cut before it).
        Stop strings count once the output has `min_tokens` tokens (vLLM's rule), in the text then added.

        Returns how many of `token_ids` came after the stop (0 without one): tokens generated past it."""
        for i, token in enumerate(token_ids):
            if self.stop is not None:
                return len(token_ids) - i
            before = len(self.text)
            self.num_tokens += 1
            if token in self.hidden:
                continue
            self.text += self.detok.step([token])
            if self.num_tokens >= self.min_tokens:
                self._find_stop(before)
        return 0

    def _find_stop(self, before: int) -> None:
        for stop in self.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text, self.stop = self.text[:at], stop
                return

    def take(self, finished: bool) -> str:
        """The text not yet taken that may be sent: all of it once finished or stopped, else all but
        the hold-back."""
        end = len(self.text) if finished or self.stop is not None else max(self.num_emitted_chars,
                                                                          len(self.text) - self.hold)
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new
