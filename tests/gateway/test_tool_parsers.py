"""Tool-call parsers (hermes, llama3_json, mistral): whole outputs, and streams fed in random pieces."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine.text.tokenizer import Tokenizer
from gateway.tool_parsers import TOOL_PARSERS, get_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED = '{"name": "run", "arguments": {"code": "print(\\"}{\\")\\n", "opts": {"a": [1, 2.5e3, null, true]}}}'

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes", f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{NESTED}\n</tool_call>\n",
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                       ("run", '{"code": "print(\\"}{\\")\\n", "opts": {"a": [1, 2.5e3, null, true]}}')]),
    ("hermes", '<tool_call>{"arguments": {"q": "日本 😀"}, "name": "search"}</tool_call> Done.', "Done.",
     [("search", '{"q": "日本 😀"}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "parameters": {}}', None, [("f", "{}")]),  # no close at the end
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("hermes", 'a <tool_call>{"name": "f"}</tool_call>', 'a <tool_call>{"name": "f"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("hermes", "x < y and <tool <tool_call", "x < y and <tool <tool_call", []),
    ("hermes", f'<tool_call><tool_call>{WEATHER}</tool_call>', "<tool_call>",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("llama3_json", WEATHER.replace("arguments", "parameters"), None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("llama3_json", f" <|python_tag|>{WEATHER}; {NESTED}", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("run", '{"code": "print(\\"}{\\")\\n", "opts": {"a": [1, 2.5e3, null, true]}}')]),
    ("llama3_json", f"{WEATHER}\n\nI called the tool.", "I called the tool.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("llama3_json", f"{WEATHER}; nope", "; nope", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "  ", "  ", []),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {NESTED}]", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("run", '{"code": "print(\\"}{\\")\\n", "opts": {"a": [1, 2.5e3, null, true]}}')]),
    ("mistral", f"I will look.[TOOL_CALLS][{WEATHER}]", "I will look.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, 7]", ", 7]", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("mistral", "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ("mistral", "[TOOL_CALLS", "[TOOL_CALLS", []),
]


def test_registry():
    """vLLM's names are registered; an unknown name is refused naming the known ones."""
    assert {"hermes", "llama3_json", "mistral"} <= set(TOOL_PARSERS)
    assert get_tool_parser("hermes") is TOOL_PARSERS["hermes"]
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; known: hermes, llama3_json, mistral"):
        get_tool_parser("nope")
    assert not any(p.skip_special_tokens for p in TOOL_PARSERS.values())  # markers may be special tokens


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse(name, text, content, calls):
    """Calls come out with their arguments as written; text that is no call stays content; whitespace
    touching a call is dropped."""
    got_content, got_calls = get_tool_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(json.loads(c.arguments) is not None for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_ids():
    """Mistral's calls get the 9-alphanumeric ids its template requires, the others OpenAI's."""
    _, [call] = get_tool_parser("mistral").parse(f"[TOOL_CALLS] [{WEATHER}]")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    _, [call] = get_tool_parser("hermes").parse(f"<tool_call>{WEATHER}</tool_call>")
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)


def test_mistral_ids_pass_its_template():
    """Mistral's template raises unless tool call ids are 9 alphanumerics; the mistral parser's ids pass."""
    source = (Path(__file__).parent / "chat_templates" / "mistral.jinja").read_text()
    tok = Tokenizer(BackendTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token="<s>",
                    eos_token="</s>", add_bos_token=False, chat_template=source, name="mistral")
    _, [call] = get_tool_parser("mistral").parse(f"[TOOL_CALLS] [{WEATHER}]")
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    assert f'"id": "{call.id}"}}]</s>[TOOL_RESULTS] {{"content": 22 C, "call_id": "{call.id}"}}' in (
        tok.apply_chat_template(chat))
    chat[1]["tool_calls"][0]["id"] = chat[2]["tool_call_id"] = "call_0123456789abcdef01234567"
    with pytest.raises(ValueError, match="Tool call IDs should be alphanumeric strings with length 9"):
        tok.apply_chat_template(chat)


def stream_in_pieces(name: str, text: str, seed: int, max_piece: int = 8) -> list[dict]:
    """Deltas of `text` fed to a fresh stream in random pieces of 1..max_piece characters."""
    rng, stream, deltas, pos = random.Random(seed), get_tool_parser(name).stream(), [], 0
    while pos < len(text):
        n = rng.randint(1, max_piece)
        deltas += stream.feed(text[pos:pos + n])
        pos += n
    return deltas + stream.finish()


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from streamed deltas, checking they are shaped as OpenAI's."""
    content, calls, ids = [], [], set()
    for delta in deltas:
        assert len(delta) == 1 and delta != {"content": ""}
        if "content" in delta:
            content.append(delta["content"])
            continue
        [piece] = delta["tool_calls"]
        if "id" in piece:  # a call's first piece: index, id, type, name, arguments ""
            assert piece["index"] == len(calls) and piece["type"] == "function" and piece["id"] not in ids
            assert piece["function"]["arguments"] == "" and piece["function"]["name"]
            ids.add(piece["id"])
            calls.append([piece["function"]["name"], ""])
        else:  # later pieces of the latest call
            assert set(piece) == {"index", "function"} and piece["index"] == len(calls) - 1
            assert set(piece["function"]) == {"arguments"} and piece["function"]["arguments"]
            calls[-1][1] += piece["function"]["arguments"]
    return "".join(content) or None, [tuple(c) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_matches_parse(name, text, content, calls):
    """Fed in random pieces (several seeds, and one character at a time), the stream gives parse's content
    and calls: nothing that turns out to be a call is sent as content first."""
    for seed in range(6):
        assert assemble(stream_in_pieces(name, text, seed)) == (content, calls), seed
    assert assemble(stream_in_pieces(name, text, 0, max_piece=1)) == (content, calls)


def test_stream_sends_a_call_once_its_name_is_complete():
    """A marker's first characters are held back; the call's first delta comes as soon as its name is
    complete and its arguments have begun, then the arguments stream as they arrive."""
    def args(text):
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool_") == [{"content": "Hi"}]
    assert stream.feed('call>{"name": "get_wea') == []
    header, piece = stream.feed('ther", "arguments": {"ci')
    assert header == {"tool_calls": [{"index": 0, "id": header["tool_calls"][0]["id"], "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}
    assert piece == args('{"ci')
    assert stream.feed('ty": "Pa') == [args('ty": "Pa')]
    assert stream.feed('ris"}}\n</tool_call>\n') == [args('ris"}')]
    assert stream.finish() == []


def test_stream_arguments_arrive_incrementally():
    """Arguments are not held to the end: each feed inside them yields what it carried."""
    stream = get_tool_parser("mistral").stream()
    stream.feed('[TOOL_CALLS] [{"name": "f", "arguments": {')
    assert stream.feed('"a": 1, ') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"a": 1, '}}]}]
    assert stream.feed('"b": 2}}]') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"b": 2}'}}]}]
    assert stream.finish() == []


def test_stream_keeps_a_sent_call_that_breaks():
    """Once sent, a call stays a call; if its object breaks, what follows is content (documented divergence
    from parse, which keeps the whole region as content)."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}, oops}</tool_call>'
    assert get_tool_parser("hermes").parse(text) == (text, [])
    content, calls = assemble(stream_in_pieces("hermes", text, 0))
    assert calls == [("f", '{"a": 1}')] and content == "oops}</tool_call>"
    content, calls = assemble(stream_in_pieces("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', 0))
    assert (content, calls) == (None, [("f", '{"a": 1')])  # cut by max_tokens


_FRAGMENTS = ["Hello", " ", "\n", "<", "<tool", "[TOOL", "{", "}", "[", "]", ";", ",", "x < 3", "😀 日本", '"q"',
              "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"a": 1}', "\t"]


def _random_call(rng: random.Random) -> tuple[str, str, str]:
    """(JSON text of a call object, name, arguments text) in random key order and spacing."""
    name = rng.choice(["get_weather", "search", "f_2", "run-it"])
    arguments = rng.choice(['{}', '{"city": "Paris"}', '{"q": "a \\"quoted\\" }{ ]["}', '{"n": [1, {"x": null}]}',
                            '{\n  "deep": {"er": [true, false, -1.5e-3]}\n}', '{"s": "日本語 😀 \\u00e9"}'])
    key = rng.choice(["arguments", "arguments", "parameters"])
    members = [f'"name":{rng.choice(["", " "])}{json.dumps(name)}', f'"{key}": {arguments}']
    if rng.random() < 0.3:
        members.insert(rng.randrange(3), '"extra": [1, "}"]')
    rng.shuffle(members)
    sep = rng.choice([", ", ",", ",\n  "])
    return "{" + rng.choice(["", " ", "\n"]) + sep.join(members) + rng.choice(["", " "]) + "}", name, arguments


def _random_output(rng: random.Random, name: str) -> str:
    """Text mixing content fragments and calls in `name`'s format, as a model might write it."""
    parts = []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            parts.append("".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 4))))
        calls = [_random_call(rng)[0] for _ in range(rng.randint(1, 3))]
        if name == "hermes":
            parts += [f"<tool_call>{rng.choice(['', chr(10)])}{c}{rng.choice(['', chr(10)])}</tool_call>"
                      for c in calls]
        elif name == "mistral":
            parts.append(f"[TOOL_CALLS]{rng.choice(['', ' '])}[{', '.join(calls)}]")
        elif not parts:
            parts.append(rng.choice(["", "<|python_tag|>"]) + "; ".join(calls))
    return "".join(parts)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_random_outputs_stream_like_parse(name):
    """On random mixes of content, marker-like fragments and calls, the stream and parse agree."""
    rng = random.Random(name)
    for _ in range(150):
        text = _random_output(rng, name)
        content, calls = get_tool_parser(name).parse(text)
        expected = (content, [(c.name, c.arguments) for c in calls])
        for seed in range(3):
            assert assemble(stream_in_pieces(name, text, seed)) == expected, (text, seed)


def test_random_calls_are_found():
    """Calls written alone, in any key order and spacing, parse to their name and arguments as written."""
    rng = random.Random(0)
    for _ in range(200):
        text, name, arguments = _random_call(rng)
        assert get_tool_parser("hermes").parse(f"<tool_call>{text}</tool_call>")[1][0].arguments == arguments
        [call] = get_tool_parser("llama3_json").parse(text)[1]
        assert (call.name, call.arguments) == (name, arguments)


def test_the_spec_names_every_registered_parser():
    """`--tool-call-parser` / `--reasoning-parser` (cluster/spec.py, a leaf that cannot import these)
    take exactly the registries' names."""
    from cluster.spec import REASONING_PARSERS, TOOL_CALL_PARSERS
    from gateway.reasoning import REASONING_PARSERS as REASONING_REGISTRY
    from gateway.tool_parsers import TOOL_PARSERS
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS) and set(REASONING_PARSERS) == set(REASONING_REGISTRY)
