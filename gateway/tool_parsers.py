"""Tool-call parsers: the calls a model wrote in its own format, whole or streamed (vLLM's --tool-call-parser).

Each format puts call objects `{"name": ..., "arguments": {...}}` in a *region* of the output:

    [marker] ws [open] ws call ( ws sep ws call )* ws [close]

    hermes       <tool_call> {call} </tool_call>          one call per region, regions anywhere
    llama3_json  [<|python_tag|>] {call} ; {call}          only at the start of the output
    mistral      [TOOL_CALLS] [ {call} , {call} ]          regions anywhere

The rules, the same whole (`parse`) and streamed (`stream`):
- A region whose first call does not parse is text: its marker stays content and the search goes on after it.
  When a later call of a region does not parse, the text from its separator on is content.
- Whitespace touching a call is dropped from the content; content that is only whitespace is None.
- Arguments are the text the model wrote for the value of "arguments" (or "parameters"), or the
  contents of a string value: the streamed pieces of a call concatenate to its non-streamed arguments.
- Streamed, a call is sent (id, name, arguments "") once its name is complete and its arguments have
  begun; text that may still become a call (`<tool_` of `<tool_call>`, a call without a name yet) is held
  back. Once sent, a call stays one: if its object then breaks (or the output stops inside it) the
  text after the break is content, where `parse` would have kept the whole region as content.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.spec import spec_registry
from gateway.tools import (CallScanner, ScanStatus, ToolCall, new_mistral_tool_call_id, new_tool_call_id,
                           parse_call_object, skip_ws)

logger = logging.getLogger(__name__)

Delta = dict[str, Any]  # one chat.completion.chunk `choices[0].delta`: {"content": ...} or {"tool_calls": [...]}


@dataclass(frozen=True)
class CallFormat:
    """Where a model writes its calls (see the module docstring)."""
    markers: tuple[str, ...] = ()  # what opens a region
    open: str = ""                 # required right after the marker
    sep: str = ""                  # between the calls of one region
    close: str = ""                # optional end of a region
    at_start_only: bool = False    # one region at most, at the start (a marker there is optional)


@dataclass(frozen=True)
class ToolParser:
    """One model family's tool-call format."""
    name: str
    format: CallFormat
    make_id: Callable[[], str] = new_tool_call_id
    # False: a marker can be a special token (<tool_call> is one in Hermes 2 Pro, [TOOL_CALLS] in Mistral,
    # <|python_tag|> in Llama 3.1), so the text given to the parser must be detokenized keeping them
    skip_special_tokens: bool = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Split a whole output into content (None when empty) and the calls in it."""
        return _parse(self.format, text, self.make_id)

    def stream(self) -> ToolCallStream:
        """A fresh streaming parser for one output."""
        return ToolCallStream(self.format, self.make_id)


_REQUIRED = CallFormat(open="[", sep=",", close="]", at_start_only=True)  # tools.required_schema's output

# The spec's `tool_call_parser` choices: the same names, checked at import
TOOL_PARSERS = spec_registry("tool_call_parser", {p.name: p for p in (
    ToolParser("hermes", CallFormat(markers=("<tool_call>",), close="</tool_call>")),
    ToolParser("llama3_json", CallFormat(markers=("<|python_tag|>",), sep=";", at_start_only=True)),
    ToolParser("mistral", CallFormat(markers=("[TOOL_CALLS]",), open="[", sep=",", close="]"),
               make_id=new_mistral_tool_call_id),
)})


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name` (TOOL_PARSERS). Raises ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def required_stream(make_id: Callable[[], str] = new_tool_call_id) -> ToolCallStream:
    """Streaming form of `tools.calls_from_required` (output constrained by `tools.required_schema`)."""
    return ToolCallStream(_REQUIRED, make_id)


# ---------------------------------------------------------------------------------------------------------------
# Whole output


def _find_region(fmt: CallFormat, text: str, pos: int) -> tuple[int, int] | None:
    """(marker start, marker end) of the next region at or after `pos`."""
    if fmt.at_start_only:
        start = skip_ws(text, pos)
        return next(((start, start + len(m)) for m in fmt.markers if text.startswith(m, start)), (start, start))
    found = [(i, i + len(m)) for m in fmt.markers if (i := text.find(m, pos)) >= 0]
    return min(found) if found else None


def _parse_region(fmt: CallFormat, text: str, pos: int, make_id) -> tuple[list[ToolCall], int] | None:
    """The calls of the region whose marker ends at `pos`, and where the content resumes."""
    pos = skip_ws(text, pos)
    if fmt.open:
        if not text.startswith(fmt.open, pos):
            return None
        pos = skip_ws(text, pos + len(fmt.open))
    calls: list[ToolCall] = []
    sep_at = pos
    while (got := parse_call_object(text, pos)) is not None:
        calls.append(ToolCall(got[0], got[1], make_id()))
        pos = skip_ws(text, got[2])
        if fmt.sep and text.startswith(fmt.sep, pos):
            sep_at, pos = pos, skip_ws(text, pos + len(fmt.sep))
        elif fmt.close and text.startswith(fmt.close, pos):
            return calls, pos + len(fmt.close)
        else:
            return calls, pos
    return (calls, sep_at) if calls else None


def _parse(fmt: CallFormat, text: str, make_id) -> tuple[str | None, list[ToolCall]]:
    pieces: list[str | ToolCall] = []
    pos = 0
    while (region := _find_region(fmt, text, pos)) is not None:
        start, body = region
        pieces.append(text[pos:start])
        if (got := _parse_region(fmt, text, body, make_id)) is None:
            pieces.append(text[start:body])  # not calls: the marker is text
            pos = body
        else:
            pieces.extend(got[0])
            pos = got[1]
        if fmt.at_start_only:
            break
    pieces.append(text[pos:])
    return _join(pieces)


def _join(pieces: list[str | ToolCall]) -> tuple[str | None, list[ToolCall]]:
    """Content and calls; whitespace touching a call is dropped."""
    merged: list[str | ToolCall] = []  # alternating text and calls
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    texts = []
    for k, piece in enumerate(merged):
        if isinstance(piece, str):
            piece = piece.lstrip() if k > 0 else piece
            texts.append(piece.rstrip() if k + 1 < len(merged) else piece)
    return "".join(texts) or None, [p for p in merged if isinstance(p, ToolCall)]


# ---------------------------------------------------------------------------------------------------------------
# Streaming


class _Deltas:
    """The deltas of one `feed`; holds trailing whitespace of the content until it is known not to touch a call."""

    def __init__(self):
        self.items: list[Delta] = []
        self._ws = ""
        self._after_call = False

    def content(self, text: str) -> None:
        if self._after_call:
            if not (text := text.lstrip()):
                return
            self._after_call = False
        if body := text.rstrip():
            self._add_content(self._ws + body)
            self._ws = ""
        self._ws += text[len(body):]

    def _add_content(self, text: str) -> None:
        if self.items and "content" in self.items[-1]:
            self.items[-1]["content"] += text
        else:
            self.items.append({"content": text})

    def call(self, index: int, call_id: str, name: str) -> None:
        self._ws = ""
        self.items.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.items[-1]["tool_calls"][0] if self.items and "tool_calls" in self.items[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self.items.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def call_ended(self) -> None:
        self._after_call = True

    def flush(self) -> None:
        """At the end: whitespace that touches no call is content after all."""
        if self._ws:
            self._add_content(self._ws)
            self._ws = ""

    def take(self) -> list[Delta]:
        items, self.items = self.items, []
        return items


class _State(enum.Enum):
    START = 0    # at_start_only formats, before anything but whitespace
    CONTENT = 1  # text; looking for a marker
    OPEN = 2     # after a marker, before the open token
    CALL = 3     # inside a call object
    AFTER = 4    # after a call: a separator, the close token, or back to text


class ToolCallStream:
    """Streaming form of a parser: `feed` text deltas, get chat-completion-chunk deltas.

    Deltas, in order: `{"content": "..."}`; a call's first piece `{"tool_calls": [{"index": i, "id": ...,
    "type": "function", "function": {"name": ..., "arguments": ""}}]}`; then its arguments
    `{"tool_calls": [{"index": i, "function": {"arguments": "<more>"}}]}`. Calls are numbered from 0.
    """

    def __init__(self, fmt: CallFormat, make_id: Callable[[], str]):
        self._fmt, self._make_id = fmt, make_id
        self._out = _Deltas()
        self._buf = ""       # received, not consumed
        self._state = _State.START if fmt.at_start_only else _State.CONTENT
        self._marker = ""    # what opened the current call: a marker, the separator or "" (implicit)
        self._raw = ""       # consumed since the marker while the call is not sent (to fall back to text)
        self._call: CallScanner | None = None
        self._sent = False   # the current call has been sent
        self._index = -1     # index of the latest call sent
        self._handlers = {_State.START: self._start, _State.CONTENT: self._content, _State.OPEN: self._open,
                          _State.CALL: self._scan_call, _State.AFTER: self._after}

    def feed(self, text: str) -> list[Delta]:
        """Deltas for `text` and anything held back that it decides."""
        self._buf += text
        self._run(final=False)
        return self._out.take()

    def finish(self) -> list[Delta]:
        """At the end of the output: everything still held back."""
        self._run(final=True)
        self._out.flush()
        return self._out.take()

    def _run(self, final: bool) -> None:
        while self._handlers[self._state](final):
            pass

    def _begin_call(self, marker: str) -> None:
        self._marker, self._raw, self._sent = marker, "", False
        self._call = CallScanner()

    def _fall_back(self) -> None:
        """The call did not parse before it was sent: its marker is text, and what followed is read again."""
        self._out.content(self._marker)
        self._buf = self._raw + self._buf
        self._raw = self._marker = ""
        self._call, self._state = None, _State.CONTENT

    def _start(self, final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        self._out.content(self._buf[:i])
        self._buf = buf = self._buf[i:]
        if not buf:
            return False
        if any(m.startswith(buf) and m != buf for m in self._fmt.markers) and not final:
            return False
        marker = next((m for m in self._fmt.markers if buf.startswith(m)), "")
        self._buf = buf[len(marker):]
        self._begin_call(marker)
        self._state = _State.OPEN
        return True

    def _content(self, final: bool) -> bool:
        buf, markers = self._buf, () if self._fmt.at_start_only else self._fmt.markers
        found = min(((i, m) for m in markers if (i := buf.find(m)) >= 0), default=None)
        if found is not None:
            i, marker = found
            self._out.content(buf[:i])
            self._buf = buf[i + len(marker):]
            self._begin_call(marker)
            self._state = _State.OPEN
            return True
        keep = 0 if final else max((k for m in markers for k in range(1, len(m)) if buf.endswith(m[:k])),
                                   default=0)
        self._out.content(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _open(self, final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        self._raw += self._buf[:i]
        self._buf = buf = self._buf[i:]
        token = self._fmt.open
        if buf.startswith(token):
            self._raw += token
            self._buf = buf[len(token):]
            self._state = _State.CALL
        elif not final and token.startswith(buf):
            return False
        else:
            self._fall_back()
        return True

    def _scan_call(self, final: bool) -> bool:
        call = self._call
        if not self._buf:
            if not final:
                return False
            status = ScanStatus.ERROR  # the output stopped inside the call
        else:
            n, status = call.push(self._buf)
            if not self._sent:
                self._raw += self._buf[:n]
            self._buf = self._buf[n:]
        if not self._sent and call.name is not None and call.arguments_begun:
            self._index += 1
            self._out.call(self._index, self._make_id(), call.name)
            self._sent, self._raw = True, ""
        if self._sent:
            self._out.arguments(self._index, call.take_arguments())
        if status is ScanStatus.MORE:
            return False
        if not self._sent:
            self._fall_back()
            return True
        if status is ScanStatus.ERROR:
            logger.debug("tool call %d broke off after it was sent; the rest is content", self._index)
        self._out.call_ended()
        self._call = None
        self._state = _State.AFTER if status is ScanStatus.DONE else _State.CONTENT
        return True

    def _after(self, final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        self._buf = buf = self._buf[i:]
        sep, close = self._fmt.sep, self._fmt.close
        if not buf:
            return False
        if sep and buf.startswith(sep):
            self._buf = buf[len(sep):]
            self._begin_call(sep)
            self._state = _State.CALL
            return True
        if close and buf.startswith(close):
            self._buf = buf[len(close):]
        elif not final and any(t and t.startswith(buf) for t in (sep, close)):
            return False
        self._state = _State.CONTENT
        return True


class NamedCallStream:
    """Streaming form of `tools.call_from_named`: the whole output is the named function's arguments."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_tool_call_id):
        self._name, self._make_id = name, make_id
        self._sent = self._begun = False
        self._ws = ""  # trailing whitespace, held: the arguments are the stripped output

    def _header(self) -> list[Delta]:
        if self._sent:
            return []
        self._sent = True
        return [{"tool_calls": [{"index": 0, "id": self._make_id(), "type": "function",
                                 "function": {"name": self._name, "arguments": ""}}]}]

    def feed(self, text: str) -> list[Delta]:
        deltas = self._header()
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        if body := text.rstrip():
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": self._ws + body}}]})
            self._ws = ""
        self._ws += text[len(body):]
        return deltas

    def finish(self) -> list[Delta]:
        return self._header()
