"""Reasoning parsers: split `<think>...</think>` from the answer (vLLM's --reasoning-parser).

    [content] <think> reasoning </think> content
    [content] <content start> content                   (a parser with one: gpt-oss's final channel)

`openai_gptoss` reads gpt-oss's harmony channels, special tokens kept in the text: the analysis
channel is the reasoning, the final channel the content (its template ends the prompt with
`<|start|>assistant`; the model writes `<|channel|>analysis<|message|>...<|end|>` and then
`<|start|>assistant<|channel|>final<|message|>...`, or the final channel alone). Tool calls on its
commentary channel are not parsed (they stay in the text).

- The output may start inside the reasoning: the chat template already wrote `<think>` into the
  prompt (DeepSeek-R1, Qwen3 thinking-2507 and later) and only `</think>` comes. `deepseek_r1` always
  reads the output so (a `<think>` the model writes first is skipped); `qwen3` does when told, see
  `starts_in_reasoning(prompt)`. Otherwise text before `<think>` is content, and output without tags is
  all content (Qwen3 with `enable_thinking=False`, whose template writes `<think>\\n\\n</think>` itself).
- No `</think>` (the output was cut): everything after the start of the reasoning is reasoning.
- Whitespace touching a tag is dropped; what is left empty is None.
- Streamed, text that may be the start of a tag is held back; the pieces concatenate to `parse`'s.

The content then goes on to the tool-call parser, if any (Qwen3 writes hermes `<tool_call>`s after `</think>`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster.spec import spec_registry


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's reasoning tags."""
    name: str
    always_in_reasoning: bool  # the output starts inside the reasoning, whatever the prompt
    start: str = "<think>"
    end: str = "</think>"
    content_start: str | None = None  # a tag that opens the content directly (no reasoning before it)
    keeps_special_tokens: bool = False  # its tags are special tokens: the text is decoded with them

    def starts_in_reasoning(self, prompt: str | None = None) -> bool:
        """Whether the output starts inside the reasoning: always for deepseek_r1; for qwen3 when the
        rendered prompt ends with the start tag (the template opened the reasoning)."""
        return self.always_in_reasoning or (prompt is not None and prompt.rstrip().endswith(self.start))

    def parse(self, text: str, *, in_reasoning: bool | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; `in_reasoning` None: `starts_in_reasoning()`."""
        before = ""
        if self.starts_in_reasoning() if in_reasoning is None else in_reasoning:
            body = text.lstrip()
            body = body[len(self.start):] if body.startswith(self.start) else body
        else:
            at, tag = first_tag(text, self.tags)
            if tag is None:
                return None, text or None
            before, body = text[:at].rstrip(), text[at + len(tag):]
            if tag != self.start:  # the content opened directly
                return None, before + body.lstrip() or None
        reasoning, tag, after = body.partition(self.end)
        content = before + after.lstrip() if tag else before
        return reasoning.strip() or None, content or None

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags that may end the content before the reasoning: the start, and any content start."""
        return (self.start,) if self.content_start is None else (self.start, self.content_start)

    def stream(self, *, in_reasoning: bool | None = None) -> ReasoningStream:
        """A fresh streaming parser for one output."""
        return ReasoningStream(self, self.starts_in_reasoning() if in_reasoning is None else in_reasoning)


# The spec's `reasoning_parser` choices: the same names, checked at import
REASONING_PARSERS = spec_registry("reasoning_parser", {p.name: p for p in (
    ReasoningParser("deepseek_r1", always_in_reasoning=True),
    ReasoningParser("qwen3", always_in_reasoning=False),
    ReasoningParser("openai_gptoss", always_in_reasoning=False, start="<|channel|>analysis<|message|>",
                    end="<|end|><|start|>assistant<|channel|>final<|message|>",
                    content_start="<|channel|>final<|message|>", keeps_special_tokens=True),
)})


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the earliest of `tags` starts in `text`, and which (-1, None: none does)."""
    found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else (-1, None)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name` (REASONING_PARSERS). Raises ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


class _Text:
    """One output channel: drops leading whitespace when told, holds trailing whitespace until text follows."""

    def __init__(self, drop_leading: bool):
        self._parts: list[str] = []
        self._ws = ""
        self.drop_leading = drop_leading

    def add(self, text: str) -> None:
        if self.drop_leading:
            if not (text := text.lstrip()):
                return
            self.drop_leading = False
        if body := text.rstrip():
            self._parts += [self._ws, body]
            self._ws = ""
        self._ws += text[len(body):]

    def drop_ws(self) -> None:
        self._ws = ""

    def flush(self) -> None:
        self._parts.append(self._ws)
        self._ws = ""

    def take(self) -> str | None:
        text, self._parts = "".join(self._parts), []
        return text or None


class _State(enum.Enum):
    BEFORE = 0     # content; the start tag may come
    OPENING = 1    # at the start of the reasoning; the model may still write the start tag
    REASONING = 2  # until the end tag
    AFTER = 3      # content to the end


def _held(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper start of `tag`."""
    return max((k for k in range(1, len(tag)) if buf.endswith(tag[:k])), default=0)


class ReasoningStream:
    """Streaming form of `ReasoningParser.parse`: `feed(delta) -> (reasoning_delta, content_delta)`, each
    None when there is nothing new; `finish()` the same for what was held back."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self._start, self._end, self._tags = parser.start, parser.end, parser.tags
        self._state = _State.OPENING if in_reasoning else _State.BEFORE
        self._buf = ""
        self._reasoning, self._content = _Text(drop_leading=True), _Text(drop_leading=False)

    def feed(self, text: str) -> tuple[str | None, str | None]:
        self._buf += text
        self._run(final=False)
        return self._reasoning.take(), self._content.take()

    def finish(self) -> tuple[str | None, str | None]:
        self._run(final=True)
        self._reasoning.drop_ws()
        self._content.flush()
        return self._reasoning.take(), self._content.take()

    def _run(self, final: bool) -> None:
        while self._buf and self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        buf, state = self._buf, self._state
        if state is _State.AFTER:
            self._content.add(buf)
            self._buf = ""
            return False
        if state is _State.OPENING:
            self._buf = buf = buf.lstrip()  # dropped either way: it touches the reasoning
            if not final and self._start.startswith(buf) and buf != self._start:
                return False
            if buf.startswith(self._start):
                self._buf = buf[len(self._start):]
            self._state = _State.REASONING
            return True
        tags, out = (self._tags, self._content) if state is _State.BEFORE else ((self._end,), self._reasoning)
        i, tag = first_tag(buf, tags)
        if tag is None:
            keep = 0 if final else max(_held(buf, t) for t in tags)
            out.add(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        out.add(buf[:i])
        out.drop_ws()
        self._buf = buf[i + len(tag):]
        if tag == self._start and state is _State.BEFORE:
            self._state = _State.REASONING
        else:  # the end of the reasoning, or a content start
            self._state, self._content.drop_leading = _State.AFTER, True
        return True
