"""Tool definitions (OpenAI's `tools` and `tool_choice`), the JSON schemas that force a call, and tool calls.

`tool_choice` "auto" leaves the model free and a parser (`gateway/tool_parsers.py`) finds the calls it
wrote in its own format. "required" and a named function are enforced instead: the output is constrained
by a JSON schema (vLLM's approach), `required_schema` (an array of `{"name", "parameters"}`) or
`named_schema` (the arguments object itself), and `calls_from_required` / `call_from_named` read the
constrained output back into calls. Arguments stay the text the model wrote (the value of its
"arguments" or "parameters" key), so streamed pieces always concatenate to the non-streamed string.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
import enum
from dataclasses import dataclass, field
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

TOOL_CHOICES = ("none", "auto", "required")
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3.1 writes "parameters", most others "arguments"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_JSON_WS = " \t\n\r"
_ALNUM = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """OpenAI's form: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def new_mistral_tool_call_id() -> str:
    """Mistral's chat templates refuse any tool call id but 9 alphanumerics (mistral-common's rule)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message."""
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        """The `message.tool_calls[i]` entry of a chat completion."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---------------------------------------------------------------------------------------------------------------
# Validation


def _refuse_unknown(obj: dict, known: set[str], where: str) -> None:
    if unknown := sorted(set(obj) - known):
        raise ValueError(f"{where} has unknown field {unknown[0]!r}")


def _check_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as err:
        path = "".join(f"[{p!r}]" for p in err.path)
        message = " ".join(str(err.message).split())[:200]
        raise ValueError(f"{where}{path} is not a valid JSON Schema: {message}") from None
    if schema and schema.get("type") != "object":  # {} (no constraint) is taken as "no parameters"
        raise ValueError(f'{where}.type must be "object", got {schema.get("type")!r}')


def _check_function(fn: Any, where: str) -> str:
    if not isinstance(fn, dict):
        raise ValueError(f"{where} must be an object")
    _refuse_unknown(fn, _FUNCTION_KEYS, where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ValueError(f"{where}.description must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ValueError(f"{where}.strict must be a boolean")
    if fn.get("parameters") is not None:
        _check_parameters(fn["parameters"], f"{where}.parameters")
    return name


def validate_tools(tools: list[dict]) -> list[dict]:
    """Check OpenAI's `tools` array: `[{"type": "function", "function": {name, description?, parameters?,
    strict?}}]`. A null optional field counts as absent; unknown fields are refused.

    Returns:
        `tools`, unchanged (what the chat template renders).
    Raises:
        ValueError: one line naming the first problem and where it is (`tools[1].function.name ...`).
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be an array of tool definitions")
    first_index: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        _refuse_unknown(tool, _TOOL_KEYS, where)
        if tool.get("type") != "function":
            raise ValueError(f'{where}.type must be "function", got {tool.get("type")!r}')
        name = _check_function(tool.get("function"), f"{where}.function")
        if name in first_index:
            raise ValueError(f"{where}.function.name {name!r} is already defined by tools[{first_index[name]}]")
        first_index[name] = i
    return tools


def check_tool_choice(tool_choice: str | dict | None, tools: list[dict] | None) -> str | dict:
    """Check `tool_choice` against the (validated) `tools`.

    Returns:
        "none", "auto" or "required"; for `{"type": "function", "function": {"name": ...}}` the
        definition of that tool (an entry of `tools`). Absent: "auto" with tools, else "none" (OpenAI's default).
    Raises:
        ValueError: an unknown choice, a name no tool has, or any choice but "none" without tools.
    """
    tools = tools or []
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICES:
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(fn, dict) or tool_choice.get("type") != "function" or set(tool_choice) != _TOOL_KEYS
            or set(fn) != {"name"}):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    for tool in tools:
        if tool["function"]["name"] == fn["name"]:
            return tool
    raise ValueError(f"tool_choice.function.name {fn['name']!r} is not the name of any of the tools")


# ---------------------------------------------------------------------------------------------------------------
# Schemas for the forced choices


def named_schema(tool: dict) -> dict:
    """The JSON schema for `tool_choice` naming `tool`: its parameters (the output IS the arguments object)."""
    return dict(tool["function"].get("parameters") or EMPTY_PARAMETERS)


def required_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """The JSON schema for `tool_choice` "required" (vLLM's): an array of one or more (exactly one when
    `parallel_tool_calls` is false) `{"name": <a tool's name>, "parameters": <its parameters>}`.

    Each tool's `$defs` / `definitions` move to the root, where its `#/$defs/...` references point.

    Raises:
        ValueError: two tools define the same `$defs` name differently.
    """
    branches, lifted = [], {}
    for tool in tools:
        fn = tool["function"]
        parameters = dict(fn.get("parameters") or EMPTY_PARAMETERS)
        parameters.pop("$schema", None)
        for section in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(section, None) or {}).items():
                if lifted.setdefault(section, {}).setdefault(def_name, definition) != definition:
                    raise ValueError(f"tools define {section}[{def_name!r}] differently; rename one of them")
        branches.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema | lifted


# ---------------------------------------------------------------------------------------------------------------
# Reading calls


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # NaN and Infinity are not JSON


def decode_json(text: str) -> Any:
    """`json.loads` without NaN / Infinity. Raises ValueError."""
    return _DECODER.decode(text)


def skip_ws(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in _JSON_WS:
        pos += 1
    return pos


def _member(text: str, pos: int) -> tuple[str, Any, int, int] | None:
    """One `"key": value` at text[pos]: (key, value, value start, value end), or None."""
    if not text.startswith('"', pos):
        return None
    try:
        key, pos = _DECODER.raw_decode(text, pos)
        pos = skip_ws(text, pos)
        if not text.startswith(":", pos):
            return None
        start = skip_ws(text, pos + 1)
        value, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return key, value, start, end


def parse_call_object(text: str, pos: int) -> tuple[str, str, int] | None:
    """Read one call object `{"name": ..., "arguments" | "parameters": ...}` at text[pos].

    The first "name" must be a non-empty string; the first arguments key gives the arguments: the value's
    text as written, or a string value's contents (some models write the arguments JSON as a string).
    Other keys are read and ignored.

    Returns:
        (name, arguments, end), end being the position after the closing brace; None when text[pos:]
        does not start with such an object.
    """
    if not text.startswith("{", pos):
        return None
    name = arguments = None
    got_name = False
    pos = skip_ws(text, pos + 1)
    while not text.startswith("}", pos):
        if (member := _member(text, pos)) is None:
            return None
        key, value, start, pos = member
        if key == "name" and not got_name:
            got_name, name = True, value
        elif key in ARGUMENT_KEYS and arguments is None:
            arguments = value if isinstance(value, str) else text[start:pos]
        pos = skip_ws(text, pos)
        if text.startswith(",", pos):
            pos = skip_ws(text, pos + 1)
            if not text.startswith('"', pos):  # no trailing comma
                return None
        elif not text.startswith("}", pos):
            return None
    if not isinstance(name, str) or not name or arguments is None:
        return None
    return name, arguments, pos + 1


class ScanStatus(enum.Enum):
    """What `CallScanner.push` found."""
    MORE = 0   # consumed everything given
    DONE = 1   # the object closed
    ERROR = 2  # the character at the returned position cannot continue the object


_PRIMITIVE_START = set("-0123456789tfn")
_PRIMITIVE = set("0123456789+-.eEtrufalsn")


class _Value:
    """Where one JSON value ends, found as its characters arrive; validity is checked by decoding it whole."""

    def __init__(self):
        self.chars: list[str] = []
        self.kind = ""  # '"' string, "{" object or array, "p" number / true / false / null
        self._depth = 0
        self._in_string = self._escaped = False

    def push(self, ch: str) -> tuple[bool, bool]:
        """(consumed `ch`, the value is complete). Neither: `ch` cannot start a value."""
        if not self.kind:
            if ch == '"':
                self.kind, self._in_string = '"', True
            elif ch in "{[":
                self.kind, self._depth = "{", 1
            elif ch in _PRIMITIVE_START:
                self.kind = "p"
            else:
                return False, False
            self.chars.append(ch)
            return True, False
        if self.kind == "p":
            if ch in _PRIMITIVE:
                self.chars.append(ch)
                return True, False
            return False, True
        self.chars.append(ch)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                return True, self.kind == '"'
            return True, False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        return True, self._depth == 0


class CallScanner:
    """Streaming twin of `parse_call_object` (same grammar, same first-key rules): reads one call object
    as it arrives. `name` is set once complete; `take_arguments` gives the arguments text read since the
    last call (a string value's contents come whole, when it closes)."""

    def __init__(self):
        self.name: str | None = None
        self.arguments_begun = False
        self._arguments: list[str] = []
        self._state = "open"  # open, key_or_end, key_start, key, colon, value, next
        self._value: _Value | None = None
        self._key = ""
        self._role = ""  # what the value being read is: "name", "arguments" or "" (ignored)
        self._got_name = self._got_arguments = False

    def take_arguments(self) -> str:
        text, self._arguments = "".join(self._arguments), []
        return text

    def push(self, text: str) -> tuple[int, ScanStatus]:
        """Consume a prefix of `text`: (its length, status)."""
        for i, ch in enumerate(text):
            status = self._push(ch)
            if status is not ScanStatus.MORE:
                return (i + 1 if status is ScanStatus.DONE else i), status
        return len(text), ScanStatus.MORE

    def _push(self, ch: str) -> ScanStatus:
        state = self._state
        if state in ("key", "value"):
            return self._push_value(ch)
        if ch in " \t\n\r":
            return ScanStatus.MORE
        if state == "open" and ch == "{":
            self._state = "key_or_end"
        elif state in ("key_or_end", "key_start") and ch == '"':
            self._state, self._value = "key", _Value()
            return self._push_value(ch)
        elif state == "colon" and ch == ":":
            self._state, self._value = "value", _Value()
            self._role = ("name" if self._key == "name" and not self._got_name else
                          "arguments" if self._key in ARGUMENT_KEYS and not self._got_arguments else "")
            self._got_name |= self._role == "name"
            self._got_arguments |= self._role == "arguments"
        elif state == "next" and ch == ",":
            self._state = "key_start"
        elif (state == "next" or state == "key_or_end") and ch == "}":
            return ScanStatus.DONE
        else:
            return ScanStatus.ERROR
        return ScanStatus.MORE

    def _push_value(self, ch: str) -> ScanStatus:
        value = self._value
        if not value.kind and ch in " \t\n\r":
            return ScanStatus.MORE
        consumed, complete = value.push(ch)
        if not consumed and not complete:
            return ScanStatus.ERROR
        if self._role == "arguments":
            self.arguments_begun = True
            if consumed and value.kind != '"':
                self._arguments.append(ch)
        if complete:
            if not self._value_complete("".join(value.chars)):
                return ScanStatus.ERROR
            if not consumed:
                return self._push(ch)
        return ScanStatus.MORE

    def _value_complete(self, text: str) -> bool:
        try:
            decoded = decode_json(text)
        except ValueError:
            return False
        if self._state == "key":
            self._state, self._key = "colon", decoded
            return True
        role, self._state, self._role = self._role, "next", ""
        if role == "name":
            if not isinstance(decoded, str) or not decoded:
                return False
            self.name = decoded
        elif role == "arguments" and isinstance(decoded, str):
            self._arguments.append(decoded)
        return True


def calls_from_required(text: str, make_id: Callable[[], str] = new_tool_call_id) -> list[ToolCall]:
    """The calls in output constrained by `required_schema`: `[{"name": ..., "parameters": {...}}, ...]`.

    Raises:
        ValueError: the text is not such an array (say the output was cut by max_tokens).
    """
    pos = skip_ws(text, 0)
    if text.startswith("[", pos):
        calls, pos = [], skip_ws(text, pos + 1)
        while (got := parse_call_object(text, pos)) is not None:
            calls.append(ToolCall(got[0], got[1], make_id()))
            pos = skip_ws(text, got[2])
            if text.startswith(",", pos):
                pos = skip_ws(text, pos + 1)
            elif text.startswith("]", pos) and skip_ws(text, pos + 1) == len(text):
                return calls
            else:
                break
    raise ValueError(f"the output is not an array of tool calls: {text[:80]!r}")


def call_from_named(name: str, text: str, make_id: Callable[[], str] = new_tool_call_id) -> ToolCall:
    """The call in output constrained by `named_schema`: the text (stripped) is the arguments object.

    Raises:
        ValueError: the text is not a JSON object (say the output was cut by max_tokens).
    """
    arguments = text.strip()
    try:
        is_object = isinstance(decode_json(arguments), dict)
    except ValueError:
        is_object = False
    if not is_object:
        raise ValueError(f"the output is not a JSON object of arguments: {arguments[:80]!r}")
    return ToolCall(name, arguments, make_id())
