"""Tokenizer (GGUF and HF folder) against transformers, chat template, incremental detokenization."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

CHATS = [
    [{"role": "user", "content": "Hi! What's 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 日本語 😀"}],
]
STRINGS = [
    "Hello, world!", "12345", "Pi is 3.14159, e is 2.71828.", "I'm sure they'll say we've won",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))", "a  b   c\t\td\n\n\ne  ", "   leading", "trailing\n",
    "ünïcödé façade naïve", "你好，世界！日本語のテキスト。한국어", "emoji 😀👍🏽 family 👨‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "", " ", "\n",
]
# Whitespace runs right before a digit: the SmolLM2 tokenizer.json (and llama.cpp's `smollm`
# pre-tokenizer) isolate digits *first*, so "x  12" splits as "x  " + "1" + "2" and the two spaces
# merge into one token. transformers' GGUF tokenizer builder has no `smollm` entry and uses plain
# ByteLevel, which splits "x  12" as "x" + " " + " 12": different ids. We follow the model's tokenizer.
WHITESPACE_BEFORE_DIGITS = ["x  12  345", "1 2  3   4\n  5", "count:\t\t42"]
STREAM_TEXT = "Emoji 😀👍🏽 and 👨‍👩‍👧, CJK 你好世界 日本語, accents déjà vu, math ∑∫≈ done."


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_path("smollm2")


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoTokenizer
    path = resolve_model_path("smollm2")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def ref_original(ref):
    """transformers' vocab and merges with the pre-tokenizer of SmolLM2's own tokenizer.json."""
    backend = BackendTokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return backend


def _chat_texts(ref) -> list[str]:
    return [ref.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in CHATS]


def test_metadata(tok):
    """Vocabulary size, BOS/EOS ids and name come from the GGUF."""
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert "Smollm2" in tok.name


def test_encode_matches_transformers(tok, ref):
    """On varied text (code, whitespace, digits, unicode, special tokens, chat prompts) ids equal transformers'."""
    for text in STRINGS + _chat_texts(ref):
        assert tok.encode(text) == ref.encode(text), repr(text)


def test_whitespace_before_digits_follows_smollm_pre_tokenizer(tok, ref, ref_original):
    """Digits are isolated before the byte-level split, as in SmolLM2's tokenizer.json (not transformers' GGUF)."""
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS + _chat_texts(ref):
        assert tok.encode(text) == ref_original.encode(text).ids, repr(text)
    assert tok.encode("x  12") == [tok.backend.token_to_id(t) for t in ("x", "ĠĠ", "1", "2")]
    assert ref.encode("x  12") != tok.encode("x  12")  # the known divergence documented above


def test_special_tokens_are_single_ids_and_no_bos(tok):
    """Control tokens encode as one id; SmolLM2 says add_bos_token=False, so no BOS is prepended."""
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|><|endoftext|>") == [2, 0]
    assert tok.encode("hi")[0] != tok.bos_token_id


def test_decode_roundtrips(tok, ref):
    """decode(encode(s)) == s keeping specials; skipping specials matches transformers' decode."""
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS + _chat_texts(ref):
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_token_bytes_concatenate_to_the_utf8_text(tok):
    """Each token's exact bytes (some hold part of a character) join to the text's UTF-8; a
    special token gives its own text; every vocabulary entry has bytes."""
    for text in STRINGS + ["héllo — 日本 😀<|im_end|>"]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.eos_token_id) == tok.eos_token.encode()
    split = [i for i in tok.encode("😀") if "\ufffd" in tok.decode([i])]
    assert split and all(len(tok.token_bytes(i)) >= 1 for i in split)
    assert all(tok.token_bytes(i) for i in range(tok.vocab_size))


def test_chat_template_matches_transformers(tok, ref):
    """apply_chat_template renders exactly as transformers' (with and without a system message)."""
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False)
        ids = tok.encode_chat(messages)
        assert ids[:1] == [tok.bos_token_id] and ids[-4:] == tok.encode("<|im_start|>assistant\n")
        assert ids == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_chat_template_errors(tok):
    """A model without a template, and a template calling raise_exception, raise ValueError."""
    bare = Tokenizer(tok.backend, bos_token=None, eos_token=None, add_bos_token=False,
                     chat_template=None, name="bare")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])
    strict = Tokenizer(tok.backend, bos_token=None, eos_token=None, add_bos_token=False, name="strict",
                       chat_template="{% if messages[0]['role'] != 'system' %}"
                                     "{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(ValueError, match="system first"):
        strict.apply_chat_template(CHATS[0])


def _stream(tok, ids: list[int], prompt: list[int], chunk: int) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)], detok


def test_incremental_detokenizer_never_splits_characters(tok):
    """Fed one token (or three) at a time, no step emits U+FFFD and the steps concatenate to decode(ids)."""
    ids = tok.encode(STREAM_TEXT)
    prompt = tok.encode_chat(CHATS[0])
    for chunk in (1, 3):
        pieces, detok = _stream(tok, ids, prompt, chunk)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == detok.text == tok.decode(ids) == STREAM_TEXT
        assert detok.flush() == ""
    pieces, _ = _stream(tok, ids, prompt, 1)
    assert "" in pieces  # some characters did span several tokens and were held back


def test_incremental_detokenizer_skips_special_and_flushes_partial(tok):
    """Special tokens add no text; bytes of a never-completed character come out only at flush, as decode does."""
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    ids = tok.encode("ok<|im_end|>") + emoji[:-1]
    pieces, detok = _stream(tok, ids, [], 1)
    assert "".join(pieces) == "ok" and not any("\ufffd" in p for p in pieces)
    assert detok.flush() == tok.decode(ids)[len("ok"):]
    assert detok.text == tok.decode(ids) and detok.text.endswith("\ufffd")


def test_hf_folder_tokenizer_matches_transformers(ref, tmp_path):
    """A folder saved by transformers (tokenizer.json + config + chat_template.jinja) loads and matches it."""
    ref.save_pretrained(tmp_path)
    tok = Tokenizer.from_path(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.vocab_size == len(ref) and tok.name == tmp_path.name
    for text in STRINGS + WHITESPACE_BEFORE_DIGITS + _chat_texts(ref):
        assert tok.encode(text) == ref.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------------------------
# Chat templates with tools (templates in tests/gateway/chat_templates/, written after the models' own)

TOOL_TEMPLATES = Path(__file__).parents[2] / "gateway" / "chat_templates"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_ID = "abcDEF123"  # Mistral's templates want 9 alphanumerics


def _tool_chat(arguments) -> list[dict]:
    """A chat with an earlier tool call (OpenAI form: content None), its result, and a new question."""
    call = {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": "22 C"},
            {"role": "assistant", "content": "It is 22 C."}, {"role": "user", "content": "And in Rome?"}]


def _with_template(tok, source: str, name: str = "t") -> Tokenizer:
    return Tokenizer(tok.backend, bos_token="<s>", eos_token="</s>", add_bos_token=False,
                     chat_template=source, name=name)


# The text each template must write for the tools, the earlier call and its result.
TOOL_RENDERINGS = {
    "hermes": ['<tools>\n{"type": "function", "function": {"name": "get_weather", ',
               '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call><|im_end|>\n',
               "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"],
    "llama3_json": ['Environment: ipython\n', '{\n    "type": "function",\n    "function": {\n',
                    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                    '"parameters": {"city": "Paris"}}<|eot_id|>',
                    '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C"<|eot_id|>'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]</s>',
                '[TOOL_RESULTS] {"content": 22 C, "call_id": "abcDEF123"}[/TOOL_RESULTS]',
                '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '],
    # gpt-oss's harmony format: the tools as a TypeScript namespace, the call on the commentary channel
    "harmony": ["<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
                "namespace functions {\n\n", "type get_weather = (_: { city: string }) => any;",
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                "<|call|>", '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"<|end|>',
                "<|start|>assistant<|channel|>final<|message|>It is 22 C.<|end|>", "Reasoning: medium\n\n"],
}


@pytest.mark.parametrize("family", sorted(TOOL_RENDERINGS))
def test_tool_chat_templates_render_like_transformers(tok, ref, family):
    """Tools, an assistant message with tool_calls (arguments as OpenAI's JSON string) and a tool result
    render as transformers renders them with the arguments as a dict, and as the model's format wants."""
    source = (TOOL_TEMPLATES / f"{family}.jinja").read_text()
    ours = _with_template(tok, source, family).apply_chat_template(_tool_chat('{"city": "Paris"}'),
                                                                   tools=[WEATHER_TOOL])
    theirs = ref.apply_chat_template(_tool_chat({"city": "Paris"}), tools=[WEATHER_TOOL], chat_template=source,
                                     tokenize=False, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert ours == theirs
    for piece in TOOL_RENDERINGS[family]:
        assert piece in ours, piece
    assert ours.endswith({"hermes": "<|im_start|>assistant\n", "mistral": "And in Rome?[/INST]",
                          "harmony": "<|start|>user<|message|>And in Rome?<|end|><|start|>assistant",
                          "llama3_json": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[family])


def test_supports_tools_reads_the_template(tok):
    """A template reading `tools` supports them; SmolLM2's own does not (the gateway refuses tools then)."""
    assert not tok.supports_tools and "messages" in tok.template_variables
    for family in TOOL_RENDERINGS:
        assert _with_template(tok, (TOOL_TEMPLATES / f"{family}.jinja").read_text()).supports_tools, family
    assert not _with_template(tok, "{{ 'tools' }}{% set tools = 1 %}{{ tools }}").supports_tools


def test_template_kwargs_reach_the_template(tok):
    """Keyword arguments such as Qwen3's enable_thinking are template variables."""
    qwen3_tail = ("{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
                  "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
                  "{{ x | tojson(separators=(',', ':'), sort_keys=true) }}")
    t = _with_template(tok, qwen3_tail)
    assert "enable_thinking" in t.template_variables
    assert t.apply_chat_template(CHATS[0], x={"b": 1, "a": [2]}) == '<|im_start|>assistant\n{"a":[2],"b":1}'
    assert t.apply_chat_template(CHATS[0], enable_thinking=False, x=None).endswith("<think>\n\n</think>\n\nnull")


def test_harmony_reasoning_effort_reaches_the_template_as_transformers_passes_it(tok, ref):
    """gpt-oss's reasoning effort is a template variable (the gateway passes a request's
    `reasoning_effort` so): rendered as transformers renders it with the same keyword."""
    source = (TOOL_TEMPLATES / "harmony.jinja").read_text()
    chat = [{"role": "user", "content": "2+2?"}]
    ours = _with_template(tok, source, "harmony").apply_chat_template(chat, reasoning_effort="high")
    theirs = ref.apply_chat_template(chat, chat_template=source, tokenize=False, add_generation_prompt=True,
                                     reasoning_effort="high")
    assert ours == theirs and "Reasoning: high\n\n" in ours and "reasoning_effort" in _with_template(
        tok, source).template_variables


def test_tool_messages_are_normalized_for_templates(tok):
    """None-valued keys and empty tool_calls are left out (templates test `'tool_calls' in message`);
    arguments that are not JSON are refused naming the message; the caller's messages are not changed."""
    llama = _with_template(tok, (TOOL_TEMPLATES / "llama3_json.jinja").read_text())
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": []},
             {"role": "user", "content": "Bye", "name": None}]
    assert "Hello<|eot_id|>" in llama.apply_chat_template(plain)
    chat = _tool_chat("{'city': 'Paris'}")
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        llama.apply_chat_template(chat, tools=[WEATHER_TOOL])
    chat = _tool_chat('{"city": "Paris"}')
    ids = _with_template(tok, (TOOL_TEMPLATES / "hermes.jinja").read_text()).encode_chat(chat, tools=[WEATHER_TOOL])
    assert chat[2]["content"] is None and chat[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.\n\n# Tools")

