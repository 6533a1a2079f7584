"""What a chat choice's text becomes: `reasoning_content` (the server's reasoning parser), `content`,
and tool calls (the request's tool choice), whole or as stream deltas. The reasoning parser runs
first; only its content reaches the tool parser (docs/tool_calls.md).

    tool choice   the output                                   read by
    auto          free; the model writes calls its own way      the server's tool-call parser
    required      constrained: [{"name", "parameters"}, ...]     tools.calls_from_required
    named         constrained: that function's arguments         tools.call_from_named
    none          free                                           nobody (all content)
"""
from __future__ import annotations

from gateway.reasoning import ReasoningParser
from gateway.tool_parsers import NamedCallStream, ToolParser, required_stream
from gateway.tools import calls_from_required, call_from_named


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
