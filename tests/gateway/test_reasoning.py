"""Reasoning parsers (deepseek_r1, qwen3): <think>...</think> split from the answer, whole and streamed;
openai_gptoss: gpt-oss's harmony analysis channel from its final channel."""
from __future__ import annotations

import random

import pytest

from gateway.reasoning import REASONING_PARSERS, get_reasoning_parser

# (parser, in_reasoning (None: the parser's default), output, expected (reasoning, content))
CASES = [
    ("qwen3", None, "<think>\nLet me add: 2+2=4.\n</think>\n\nThe answer is 4.",
     ("Let me add: 2+2=4.", "The answer is 4.")),
    ("qwen3", None, "The answer is 4.", (None, "The answer is 4.")),  # enable_thinking=False: no tags
    ("qwen3", None, "  spaced  \n", (None, "  spaced  \n")),
    ("qwen3", None, "<think>\nstill thinking when max_tokens hit ", ("still thinking when max_tokens hit", None)),
    ("qwen3", None, "<think></think>\n\nDirect.", (None, "Direct.")),
    ("qwen3", None, "<think>\n\n</think>\n\n", (None, None)),
    ("qwen3", None, "Hmm <think>a</think> b", ("a", "Hmmb")),
    ("qwen3", None, "<think>a <thin b</think>c </think> d", ("a <thin b", "c </think> d")),
    ("qwen3", None, "x < y but <thinking> is not a tag", (None, "x < y but <thinking> is not a tag")),
    ("qwen3", True, "Reasoning only.\n</think>\n\nAnswer.", ("Reasoning only.", "Answer.")),
    ("qwen3", True, "<think>\nboth\n</think>answer", ("both", "answer")),
    ("qwen3", False, "1 </think> 2", (None, "1 </think> 2")),
    ("deepseek_r1", None, "Okay, so 2+2.\n</think>\n\n**4**", ("Okay, so 2+2.", "**4**")),
    ("deepseek_r1", None, "<think>\nOkay.\n</think>\n\n4", ("Okay.", "4")),
    ("deepseek_r1", None, "  <think>x</think>", ("x", None)),
    ("deepseek_r1", None, "cut off in the middle", ("cut off in the middle", None)),
    ("deepseek_r1", None, "", (None, None)),
    ("deepseek_r1", None, "<thin>k</think>y", ("<thin>k", "y")),
    ("deepseek_r1", None, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", None, "日本語 😀</think>答え 😀", ("日本語 😀", "答え 😀")),
    # gpt-oss: the analysis channel, then the final one; the final one alone; cut in the analysis
    ("openai_gptoss", None, "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>4", ("User asks 2+2. Answer 4.", "4")),
    ("openai_gptoss", None, "<|channel|>final<|message|>Hello there.", (None, "Hello there.")),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>cut off", ("cut off", None)),
    ("openai_gptoss", None, "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>x",
     (None, "x")),
    ("openai_gptoss", None, "no channel at all", (None, "no channel at all")),
]


def test_registry_and_starts_in_reasoning():
    """vLLM's names are registered; deepseek_r1 always starts inside the reasoning, qwen3 when the
    rendered prompt ends with <think> (the template opened it), not when it closed it (thinking disabled)."""
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'; known: deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("x")
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    assert r1.starts_in_reasoning() and r1.starts_in_reasoning("<|im_start|>assistant\n")
    assert qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n") and not qwen3.starts_in_reasoning()


@pytest.mark.parametrize("name,in_reasoning,text,expected", CASES)
def test_parse(name, in_reasoning, text, expected):
    """Reasoning and content split at the tags; whitespace touching a tag dropped; empty parts are None."""
    assert get_reasoning_parser(name).parse(text, in_reasoning=in_reasoning) == expected


def stream_in_pieces(name: str, in_reasoning, text: str, seed: int, max_piece: int = 6):
    """(reasoning, content) joined from a stream fed `text` in random pieces; every delta non-empty."""
    rng = random.Random(seed)
    stream = get_reasoning_parser(name).stream(in_reasoning=in_reasoning)
    reasoning, content, pos = [], [], 0
    pairs = []
    while pos < len(text):
        n = rng.randint(1, max_piece)
        pairs.append(stream.feed(text[pos:pos + n]))
        pos += n
    pairs.append(stream.finish())
    for r, c in pairs:
        assert r != "" and c != ""
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("name,in_reasoning,text,expected", CASES)
def test_stream_matches_parse(name, in_reasoning, text, expected):
    """Fed in random pieces (several seeds, and one character at a time) the stream gives parse's split."""
    for seed in range(8):
        assert stream_in_pieces(name, in_reasoning, text, seed) == expected, seed
    assert stream_in_pieces(name, in_reasoning, text, 0, max_piece=1) == expected


def test_stream_holds_back_only_a_possible_tag():
    """Reasoning streams as it comes; only what may be the start of </think> waits."""
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("Let me") == ("Let me", None)
    assert stream.feed(" think </th") == (" think", None)
    assert stream.feed("ink>\n\nThe") == (None, "The")
    assert stream.feed(" end.") == (None, " end.")
    assert stream.finish() == (None, None)


_FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "</think", "think>", " ", "\n\n", "word", "😀", "a<b", "x"]
_HARMONY = ["<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>",
            "<|channel|>final<|message|>", "<|channel|>", "<|end|>", "<|start|>assistant", "<|", " ", "\n", "word"]


@pytest.mark.parametrize("name,in_reasoning", [("qwen3", None), ("qwen3", True), ("deepseek_r1", None),
                                               ("openai_gptoss", None)])
def test_random_outputs_stream_like_parse(name, in_reasoning):
    """On random mixes of tags, tag-like fragments and text, the stream and parse agree."""
    rng = random.Random(f"{name}{in_reasoning}")
    parser = get_reasoning_parser(name)
    fragments = _HARMONY if name == "openai_gptoss" else _FRAGMENTS
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        expected = parser.parse(text, in_reasoning=in_reasoning)
        for seed in range(3):
            assert stream_in_pieces(name, in_reasoning, text, seed) == expected, (text, seed)
