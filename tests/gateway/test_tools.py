"""Tool definitions, tool_choice, the schemas forcing a call, and reading constrained output back into calls."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import pytest

from gateway.tool_parsers import NamedCallStream, required_stream
from gateway.tools import (ToolCall, call_from_named, calls_from_required, check_tool_choice, named_schema,
                           new_mistral_tool_call_id, new_tool_call_id, required_schema, validate_tools)


def create_tool(name: str = "get_weather", **function) -> dict:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": parameters} | function}


TOOLS = [create_tool(), create_tool("search", parameters={"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}, "required": ["query"]})]


def test_valid_tools_pass_unchanged():
    """Well-formed definitions (optional fields absent or null, `{}` parameters) come back as given."""
    tools = TOOLS + [{"type": "function", "function": {"name": "ping"}},
                     {"type": "function", "function": {"name": "a-b_9", "description": None, "parameters": {},
                                                       "strict": True}}]
    assert validate_tools(tools) is tools


@pytest.mark.parametrize("tools,message", [
    ({"type": "function"}, r"^tools must be an array"),
    ([create_tool(), "x"], r"^tools\[1\] must be an object"),
    ([{"type": "custom", "function": {"name": "f"}}], r'^tools\[0\]\.type must be "function"'),
    ([{"type": "function"}], r"^tools\[0\]\.function must be an object"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], r"^tools\[0\] has unknown field 'extra'"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}],
     r"^tools\[0\]\.function has unknown field 'returns'"),
    ([create_tool(), {"type": "function", "function": {}}], r"^tools\[1\]\.function\.name must match"),
    ([{"type": "function", "function": {"name": "has space"}}], r"^tools\[0\]\.function\.name must match"),
    ([{"type": "function", "function": {"name": "x" * 65}}], r"^tools\[0\]\.function\.name must match"),
    ([create_tool(), create_tool("search"), create_tool()],
     r"^tools\[2\]\.function\.name 'get_weather' is already defined by tools\[0\]"),
    ([create_tool(description=3)], r"^tools\[0\]\.function\.description must be a string"),
    ([create_tool(strict="yes")], r"^tools\[0\]\.function\.strict must be a boolean"),
    ([create_tool(parameters=[1])], r"^tools\[0\]\.function\.parameters must be a JSON Schema object"),
    ([create_tool(parameters={"type": "object", "properties": {"a": {"type": "bogus"}}})],
     r"^tools\[0\]\.function\.parameters\['properties'\]\['a'\]\['type'\] is not a valid JSON Schema"),
    ([create_tool(parameters={"type": "object", "required": "city"})],
     r"^tools\[0\]\.function\.parameters\['required'\] is not a valid JSON Schema"),
    ([create_tool(parameters={"type": "string"})], r'^tools\[0\]\.function\.parameters\.type must be "object"'),
    ([create_tool(parameters={"properties": {}})], r'^tools\[0\]\.function\.parameters\.type must be "object"'),
])
def test_invalid_tools_are_named_in_one_line(tools, message):
    """Each problem raises ValueError on one line that names it and the tool's index."""
    with pytest.raises(ValueError, match=message) as err:
        validate_tools(tools)
    assert "\n" not in str(err.value)


def test_tool_choice():
    """none/auto/required pass with tools; a named choice gives that tool; absent means auto (none without tools)."""
    assert [check_tool_choice(c, TOOLS) for c in ("none", "auto", "required")] == ["none", "auto", "required"]
    assert check_tool_choice({"type": "function", "function": {"name": "search"}}, TOOLS) is TOOLS[1]
    assert check_tool_choice(None, TOOLS) == "auto"
    assert check_tool_choice(None, None) == check_tool_choice("none", []) == "none"


@pytest.mark.parametrize("choice,tools,message", [
    ("required", None, "tool_choice 'required' needs tools"),
    ("auto", [], "tool_choice 'auto' needs tools"),
    ("any", TOOLS, "tool_choice must be"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope' is not the name of any of the tools"),
    ({"type": "function", "function": {"name": "search"}}, [], "is not the name of any"),
    ({"type": "function", "name": "search"}, TOOLS, "tool_choice must be"),
    ({"type": "function", "function": {"name": "search", "x": 1}}, TOOLS, "tool_choice must be"),
    (["auto"], TOOLS, "tool_choice must be"),
])
def test_bad_tool_choice(choice, tools, message):
    """Unknown choices, unknown names and choices without tools raise ValueError."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tool_choice(choice, tools)


def _valid(schema: dict, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema_accepts_exactly_calls_of_the_tools():
    """One or more {name, parameters} of a defined tool, parameters valid for that tool; one at most
    without parallel tool calls."""
    schema = required_schema(TOOLS)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    search = {"name": "search", "parameters": {"query": "x", "limit": 2}}
    assert _valid(schema, [weather]) and _valid(schema, [weather, search])
    for bad in ([], [{"name": "get_weather", "parameters": {"query": "x"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "search", "parameters": {"query": "x", "limit": 0}}], [{"name": "search"}],
                [weather | {"extra": 1}], weather):
        assert not _valid(schema, bad), bad
    single = required_schema(TOOLS, parallel_tool_calls=False)
    assert _valid(single, [search]) and not _valid(single, [weather, search])


def test_named_schema_is_the_parameters():
    """A named choice's schema is its parameters; a function without parameters takes an empty object."""
    assert named_schema(TOOLS[1]) == TOOLS[1]["function"]["parameters"]
    assert named_schema({"type": "function", "function": {"name": "ping"}}) == {"type": "object", "properties": {}}


def test_required_schema_lifts_defs_to_the_root():
    """`$defs` of a tool's parameters move to the root, so `#/$defs/...` references still resolve;
    two tools defining one name differently are refused."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = create_tool("move", parameters={"type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}},
                                           "$defs": {"Point": point}})
    schema = required_schema([tool, TOOLS[0]])
    assert schema["$defs"] == {"Point": point}
    assert _valid(schema, [{"name": "move", "parameters": {"to": {"x": 1}}}])
    assert not _valid(schema, [{"name": "move", "parameters": {"to": {"y": 1}}}])
    other = create_tool("jump", parameters={"type": "object", "$defs": {"Point": {"type": "string"}}})
    with pytest.raises(ValueError, match=r"define \$defs\['Point'\] differently"):
        required_schema([tool, other])


@pytest.mark.parametrize("schema", [required_schema(TOOLS), required_schema(TOOLS, False), named_schema(TOOLS[1])])
def test_llguidance_compiles_the_schemas(schema):
    """The engine's structured outputs (llguidance) take the schemas as they are."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    assert not is_error, messages


def _streamed_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    names, arguments = {}, {}
    for delta in deltas:
        assert set(delta) == {"tool_calls"}
        for piece in delta["tool_calls"]:
            if "id" in piece:
                names[piece["index"]] = piece["function"]["name"]
            arguments[piece["index"]] = arguments.get(piece["index"], "") + piece["function"]["arguments"]
    return [(names[i], arguments[i]) for i in sorted(names)]


def _feed_in_pieces(stream, text: str, seed: int) -> list[dict]:
    rng, deltas, pos = random.Random(seed), [], 0
    while pos < len(text):
        n = rng.randint(1, 7)
        deltas += stream.feed(text[pos:pos + n])
        pos += n
    return deltas + stream.finish()


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    '[{"name":"get_weather","parameters":{"city":"Köln \\"am Rhein\\""}},'
    '{"name":"search","parameters":{"query":"[]"}}]',
    ' [ {"parameters": {"query": "x", "limit": 3}, "name": "search"} ]\n',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_calls_from_required_keep_the_arguments_text(text):
    """Each call's arguments are its "parameters" value as written; streamed in random pieces they
    concatenate to the same strings."""
    value = json.loads(text)
    calls = calls_from_required(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(v["name"], v["parameters"]) for v in value]
    assert all(c.arguments in text for c in calls)
    for seed in range(8):
        assert _streamed_calls(_feed_in_pieces(required_stream(), text, seed)) == [(c.name, c.arguments)
                                                                                   for c in calls]


@pytest.mark.parametrize("text", ['[{"name": "get_weather", "parameters": {"city": "Pa', "[]", "{}", "",
                                  '[{"name": "f", "parameters": {}}] trailing', '[{"name": "f"}]'])
def test_calls_from_required_refuses_other_output(text):
    """Output cut short, empty, or not an array of calls raises ValueError."""
    with pytest.raises(ValueError, match="not an array of tool calls"):
        calls_from_required(text)


def test_call_from_named():
    """The stripped output is the arguments; streamed, the header comes first and pieces concatenate to it."""
    text = '  {"query": "tea", "limit": 2}\n'
    call = call_from_named("search", text)
    assert (call.name, call.arguments) == ("search", text.strip())
    for seed in range(5):
        deltas = _feed_in_pieces(NamedCallStream("search"), text, seed)
        assert deltas[0]["tool_calls"][0]["function"] == {"name": "search", "arguments": ""}
        assert _streamed_calls(deltas) == [("search", text.strip())]
    assert _streamed_calls(NamedCallStream("ping").finish()) == [("ping", "")]
    for bad in ('{"query": "te', "[1]", ""):
        with pytest.raises(ValueError, match="not a JSON object"):
            call_from_named("search", bad)


def test_ids_and_openai_form():
    """Ids follow OpenAI (call_ + 24 hex) or Mistral (9 alphanumerics); to_openai is the message entry."""
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_tool_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_mistral_tool_call_id())
    assert len({new_tool_call_id() for _ in range(100)}) == 100
    call = calls_from_required(REQUIRED_OUTPUTS[0], make_id=lambda: "abc123XYZ")[0]
    assert call == ToolCall("get_weather", '{"city": "Paris"}', "abc123XYZ")
    assert call.to_openai() == {"id": "abc123XYZ", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
