"""Tool calls and reasoning output with the official `openai` client through 1P1D (the shared server of
conftest.py: SmolLM2 with the hermes chat template, `--tool-call-parser hermes`, `--reasoning-parser
qwen3`). Required and named tool choices are enforced by the grammar, so their arguments always validate."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.gateway.test_openai_client import ask, client

pytestmark = pytest.mark.timeout(300)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
Q = ask("What is the weather in Paris, in celsius?")


def valid_calls(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_yields_valid_calls(server, parallel):
    cluster, url = server
    r = client(url).chat.completions.create(model="smollm2", messages=Q, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=parallel, max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = valid_calls(choice.message)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    cluster.assert_no_leaks()


def test_named_choice_streams_the_arguments_it_returns_whole(server):
    _, url = server
    c = client(url)
    kw = dict(model="smollm2", messages=Q, tools=TOOLS, max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = c.chat.completions.create(**kw).choices[0]
    ((name, arguments),) = valid_calls(whole.message)
    assert name == "get_weather" and whole.finish_reason == "stop"
    pieces, ends = [], []
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            pieces += [t.function.arguments or "" for t in ch.delta.tool_calls or []]
            ends.append(ch.finish_reason)
    assert json.loads("".join(pieces)) == arguments and ends[-1] == "stop"


def test_auto_reads_the_calls_the_model_writes(server):
    """tool_choice auto: the hermes parser finds the <tool_call> the model writes (here made to, by a
    regex), streamed and not; text without one is content."""
    _, url = server
    c = client(url)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    kw = dict(model="smollm2", messages=Q, tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": json.dumps(call)[1:-1].replace("\\n", "\n")
                                                 .replace("{", "\\{").replace("}", "\\}")}})
    r = c.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and valid_calls(r.message) == [("get_time", {"zone": "UTC"})]
    names, arguments = [], ""
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or []:
                names += [t.function.name] if t.function.name else []
                arguments += t.function.arguments or ""
            assert not ch.delta.content
    assert names == ["get_time"] and json.loads(arguments) == {"zone": "UTC"}
    plain = c.chat.completions.create(model="smollm2", messages=ask("Say hello."), tools=TOOLS, max_tokens=8,
                                      temperature=0).choices[0]
    assert plain.message.content and not plain.message.tool_calls


def test_a_conversation_with_calls_and_results_renders(server):
    _, url = server
    history = Q + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client(url).chat.completions.create(model="smollm2", messages=history, tools=TOOLS, max_tokens=12,
                                            temperature=0, tool_choice="none")
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_reasoning_content_split_off(server):
    """qwen3's parser: <think>...</think> becomes reasoning_content (the output made to by a regex)."""
    _, url = server
    c = client(url)
    kw = dict(model="smollm2", messages=ask("Why is the sky blue?"), max_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": "<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}"}})
    r = c.chat.completions.create(**kw).choices[0].message
    assert r.reasoning_content and r.content and "<think>" not in r.content + r.reasoning_content
    reasoning, content = "", ""
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == (r.reasoning_content, r.content)


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "object"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem(server, body, param, words):
    _, url = server
    r = httpx.post(f"{url}/chat/completions", json={"model": "smollm2", "messages": Q, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
