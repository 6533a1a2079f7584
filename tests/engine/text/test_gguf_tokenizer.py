"""A GGUF's own SentencePiece tokenizer (`tokenizer.ggml.model = llama`) against llama.cpp.

The GGUF test files carry a 512-token SentencePiece BPE vocabulary with byte fallback
(tests/engine/gguf/make_fixtures.py): qwen2.gguf with llama.cpp's default space prefix, gemma2.gguf
without one (`tokenizer.ggml.add_space_prefix = false`, as Gemma's files). The references, in
order of authority: llama.cpp itself (llama-cpp-python, when installed), ids pinned from it, and
`llamacpp_spm` below, a line-by-line port of llama.cpp's `llm_tokenizer_spm_session`.
"""
from __future__ import annotations

import heapq
import random
import re
from pathlib import Path

import pytest

from engine.quant.gguf_file import open_gguf, read_gguf_metadata
from engine.text.gguf_tokenizer import gguf_backend
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF = Path(__file__).parents[1] / "gguf"
STRINGS = [
    "Hello, world!", "the tokenizer encodes text", "12345 and 3.14159", " leading space", "   three leading",
    "trailing  ", "a  b   c\t\td", "line one\nline two\n\n", "\n", " ", "", "ünïcödé façade naïve",
    "你好，世界！日本語", "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 🇫🇷", "def f(x):\n    return x ** 2  # square",
]
SPECIAL = ["<s>hello</s> world", "x <s> y</s>", "</s></s>", "a<unk>b", "<s> spaced </s> out"]
# Verified against llama.cpp 0.3.36 (llama-cpp-python, `Llama(vocab_only=True).tokenize(text, add_bos=True,
# special=True)`) on qwen2.gguf; regenerate with test_ids_equal_llamacpp if that file's vocabulary is ever
# retrained. The last with add_bos=False: llama.cpp would add a second BOS before the text's <s>, we add none.
PINNED = {
    "Hello, world!": [1, 449, 75, 368, 291, 467, 281, 280, 460, 458, 36],
    "  two leading spaces\nand a newline": [1, 449, 449, 259, 470, 454, 449, 306, 296, 315, 271, 462, 286, 268, 13,
                                           273, 458, 261, 420, 470, 460, 356],
    "digits 2024 and 3.14": [1, 329, 457, 471, 269, 452, 419, 486, 483, 499, 292, 449, 495, 469, 480, 499],
    "naïve 日本 😀": [1, 290, 453, 198, 178, 352, 449, 233, 154, 168, 233, 159, 175, 449, 243, 162, 155, 131],
    "<s>hi</s> there": [1, 338, 457, 2, 449, 266, 263],
}


def _meta(name: str) -> dict:
    return read_gguf_metadata(open_gguf(GGUF / f"{name}.gguf"))


@pytest.fixture(scope="module", params=["qwen2", "gemma2"])
def gguf(request):
    """(name, our tokenizer, the file's metadata)."""
    return request.param, Tokenizer.from_path(GGUF / f"{request.param}.gguf"), _meta(request.param)


def llamacpp_spm(text: str, meta: dict, add_bos: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenization (src/llama-vocab.cpp), special tokens parsed: control
    and unknown tokens split out first, a space prefixed to each stretch of text that starts the input
    or follows one, spaces as '▁', then greedy merges of the adjacent pair whose concatenation is the
    token of highest score (ties: leftmost), leftovers as <0xXX> byte tokens."""
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, kind in zip(tokens, types) if kind in (2, 3, 4)), key=len, reverse=True)
    out = [meta.get("tokenizer.ggml.bos_token_id", 1)] if add_bos else []
    # every stretch of text starts the input or follows a special token: each gets the prefix
    prefix = " " if meta.get("tokenizer.ggml.add_space_prefix", True) else ""
    for i, part in enumerate(re.split(f"({'|'.join(map(re.escape, specials))})", text)):
        if i % 2:
            out.append(vocab[part])
        elif part:
            out += _spm_session((prefix + part).replace(" ", "\u2581"), vocab, scores)
    return out


def _spm_session(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    syms, prev, nxt = list(text), list(range(-1, len(text) - 1)), [*range(1, len(text)), -1]
    heap: list[tuple[float, int, int, int]] = []

    def add_bigram(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (token := vocab.get(syms[left] + syms[right])) is not None:
            heapq.heappush(heap, (-scores[token], left, right, len(syms[left]) + len(syms[right])))
    for i in range(1, len(syms)):
        add_bigram(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue  # stale: one side merged since
        syms[left], syms[right] = syms[left] + syms[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add_bigram(prev[left], left)
        add_bigram(left, nxt[left])
    out, i = [], 0
    while i != -1 and syms:
        piece = syms[i]
        out += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        i = nxt[i]
    return out


def _random_texts(n: int, seed: int = 0) -> list[str]:
    alphabet = (list("etaoinshrdlu") * 4 + list("ETAOIN0123456789") + [" "] * 12 + ["\n", "\t", "  ", ".", ","]
                + list("éüñçßø") + list("日本語你好") + ["😀", "👍🏽", "<s>", "</s>"])
    rng = random.Random(seed)
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(n)]


def test_fixtures_are_sentencepiece_without_a_chat_template():
    """Every GGUF test file carries llama.cpp's SentencePiece kind, byte tokens, and no chat template."""
    for path in sorted(GGUF.glob("*.gguf")):
        meta = read_gguf_metadata(open_gguf(path))
        assert meta["tokenizer.ggml.model"] == "llama" and 6 in meta["tokenizer.ggml.token_type"], path.name
        assert "tokenizer.chat_template" not in meta, path.name


def test_metadata_follows_llamacpp(gguf):
    """BOS/EOS from the file; BOS added by default for SentencePiece, no EOS; the vocabulary whole."""
    name, tok, meta = gguf
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.add_eos_token) == (1, 2, True, False)
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"]) and tok.chat_template is None
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]


def test_ids_equal_the_llamacpp_algorithm(gguf):
    """Ids equal a port of llama.cpp's tokenizer on fixed and random texts (spaces, newlines, digits,
    accents, CJK and emoji through byte fallback, <s> and </s> in the text), with and without BOS."""
    name, tok, meta = gguf
    for text in STRINGS + SPECIAL + _random_texts(200):
        for add_bos in (False, True):
            if add_bos and text.startswith("<s>"):
                continue  # llama.cpp adds a second BOS there; we add none
            assert tok.encode(text, add_special_tokens=add_bos) == llamacpp_spm(text, meta, add_bos), (name, text)


def test_pinned_ids_from_llamacpp():
    """Ids llama.cpp 0.3.36 gave on qwen2.gguf (BOS added), and the text back from them."""
    tok = Tokenizer.from_path(GGUF / "qwen2.gguf")
    for text, ids in PINNED.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text.replace("<s>", "").replace("</s>", " ")  # the prefix space after </s>


def test_ids_equal_llamacpp(gguf):
    """The acceptance reference: llama.cpp's own tokenizer, special tokens parsed."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (pip install '.[bench]')")
    name, tok, _ = gguf
    llm = llama_cpp.Llama(model_path=str(GGUF / f"{name}.gguf"), vocab_only=True, verbose=False)
    for text in STRINGS + SPECIAL + _random_texts(200, seed=1):
        for add_bos in (False, True):
            if add_bos and text.startswith("<s>"):
                continue
            want = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert tok.encode(text, add_special_tokens=add_bos) == want, (name, text, add_bos)


def test_decode_round_trips(gguf):
    """decode(encode(text)) is the text: the prefix space goes, '▁' and byte runs come back."""
    name, tok, _ = gguf
    for text in STRINGS + _random_texts(50, seed=2):
        if "<s>" in text or "</s>" in text:
            continue
        assert tok.decode(tok.encode(text)) == text, (name, text)
        ids = tok.encode(text, add_special_tokens=False)
        prefix = " " if name == "qwen2" and text else ""
        assert b"".join(tok.token_bytes(i) for i in ids) == (prefix + text).encode(), (name, text)
    assert tok.decode(tok.encode("<s>a</s>", add_special_tokens=False), skip_special_tokens=False).startswith("<s>")


def test_special_tokens_are_single_ids(gguf):
    """<s>, </s> in the text are their ids (special tokens parsed, as llama.cpp's `special=true`),
    skipped on decode; `<unk>` too."""
    name, tok, _ = gguf
    ids = tok.encode("<s>hello</s>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and tok.decode(ids) == "hello"
    assert 0 in tok.encode("a<unk>b", add_special_tokens=False)


def test_incremental_detokenizer_keeps_spaces_and_characters(gguf):
    """Streamed SentencePiece text equals the whole decode: no '▁' left, no split character, and
    the space at the start of a generated word is kept."""
    name, tok, _ = gguf
    text = "Emoji 😀 and CJK 你好, accents déjà vu."
    prompt, out = tok.encode("Say:"), tok.encode(" " + text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.step([t]) for t in out) + detok.flush()
    assert streamed == tok.decode(prompt + out)[len("Say:"):] and "\ufffd" not in streamed
    assert streamed.endswith(" " + text)


def test_matches_transformers_where_they_agree():
    """transformers' GGUF tokenizer is SentencePiece with a `Metaspace` prefix: it adds no '▁' to a
    text that starts with a space nor after a special token, where llama.cpp does. Elsewhere the
    ids are the same."""
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(GGUF, gguf_file="qwen2.gguf")
    tok = Tokenizer.from_path(GGUF / "qwen2.gguf")
    for text in STRINGS + _random_texts(50, seed=3):
        if not text.startswith(" ") and "<s>" not in text and "</s>" not in text:
            assert tok.encode(text) == ref.encode(text), text
    assert tok.encode(" x", add_special_tokens=False)[:2] != ref.encode(" x", add_special_tokens=False)[:2]


@pytest.mark.parametrize("kind,named", [("t5", "T5 Unigram"), ("bert", "WordPiece"), (None, "None")])
def test_other_gguf_tokenizer_kinds_are_refused_by_name(kind, named):
    """A GGUF whose tokenizer is neither byte-level BPE nor SentencePiece is refused in one line
    naming its kind, not tokenized wrong."""
    meta = {"tokenizer.ggml.tokens": ["a", "b"]} | ({"tokenizer.ggml.model": kind} if kind else {})
    with pytest.raises(ValueError, match=named) as err:
        gguf_backend(meta)
    assert "\n" not in str(err.value)
