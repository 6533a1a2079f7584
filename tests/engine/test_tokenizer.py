"""Tokenizer (GGUF and HF folder) against transformers, chat template, incremental detokenization."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from engine.loader import resolve_model_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

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


@pytest.mark.parametrize("kind,named", [("llama", "SentencePiece"), ("t5", "T5 Unigram"), (None, "None")])
def test_other_gguf_tokenizer_kinds_are_refused_by_name(kind, named):
    """A GGUF whose tokenizer is not byte-level BPE (Gemma's and older Mistral's SentencePiece)
    is refused in one line naming its kind, not tokenized wrong."""
    from engine.tokenizer import _gguf_backend
    meta = {"tokenizer.ggml.tokens": ["a", "b"]} | ({"tokenizer.ggml.model": kind} if kind else {})
    with pytest.raises(ValueError, match=named) as err:
        _gguf_backend(meta)
    assert "\n" not in str(err.value)
