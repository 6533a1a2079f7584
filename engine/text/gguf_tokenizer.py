"""A `tokenizers.Tokenizer` rebuilt from a GGUF's tokenizer metadata, as llama.cpp tokenizes.

Two kinds (`tokenizer.ggml.model`):

    gpt2   byte-level BPE (Llama 3, Qwen, SmolLM): vocabulary + merges + the pre-tokenizer regex
           named by `tokenizer.ggml.pre`.
    llama  SentencePiece (Llama 2, Mistral, Gemma): vocabulary + scores, spaces spelled '▁', a '▁'
           prefix (`tokenizer.ggml.add_space_prefix`, default on), `<0xXX>` byte fallback.

llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm_session`, src/llama-vocab.cpp) splits the
text into UTF-8 characters and repeatedly merges the adjacent pair whose concatenation is the
vocabulary token with the highest score (ties: the leftmost pair); what is left and not a token is
spelled as byte tokens. That is BPE whose merges are every split of a token into two tokens,
ranked by the token's score: `_spm_merges`. llama.cpp ignores `tokenizer.ggml.merges` for this
kind, so we do too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (`tokenizer.ggml.token_type`)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # '▁', SentencePiece's spelling of a space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp `tokenizer.ggml.pre` values whose pre-tokenizer isolates every digit before the GPT-2
# regex (llama.cpp: regexes "\p{N}" then GPT-2's; HF tokenizer.json: Digits + ByteLevel).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_SPLIT_THEN_BYTES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                     "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_DEFAULT_BOS_EOS = {"llama": (1, 2)}  # llama.cpp's ids when the file names none (src/llama-vocab.cpp)


@dataclass(frozen=True)
class GGUFSpecialTokens:
    """BOS/EOS and whether `encode` adds them, as llama.cpp reads them from a GGUF."""
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    add_eos_token: bool


def gguf_backend(meta: dict) -> BackendTokenizer:
    """The `tokenizers.Tokenizer` a GGUF's metadata describes.

    Raises:
        ValueError: a tokenizer kind other than `gpt2` and `llama` (one line, naming it).
    """
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece}
    if kind not in builders:
        what = {"t5": "T5 Unigram", "bert": "WordPiece", "rwkv": "RWKV"}.get(kind, "")
        raise ValueError(f"GGUF tokenizer model {kind!r}{f' ({what})' if what else ''} is not supported (only "
                         "byte-level BPE 'gpt2' and SentencePiece 'llama'); use a Hugging Face folder with "
                         "tokenizer.json")
    backend = builders[kind](meta)
    logger.info("tokenizer: GGUF %r (%s), %d tokens", kind, "byte-level BPE" if kind == "gpt2" else
                "SentencePiece BPE by score", backend.get_vocab_size(with_added_tokens=True))
    return backend


def gguf_special_tokens(meta: dict) -> GGUFSpecialTokens:
    """BOS/EOS tokens and flags; SentencePiece files add BOS unless they say otherwise (llama.cpp)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]
    default_bos, default_eos = _DEFAULT_BOS_EOS.get(kind, (None, None))
    bos_id = meta.get("tokenizer.ggml.bos_token_id", default_bos)
    eos_id = meta.get("tokenizer.ggml.eos_token_id", default_eos)
    return GGUFSpecialTokens(
        bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None,
        eos_token=tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))


def _token_types(meta: dict) -> list[int]:
    return meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(meta["tokenizer.ggml.tokens"])


def _add_marked_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int],
                       special_types: tuple[int, ...]) -> None:
    """Tokens llama.cpp matches whole in the raw text, before tokenizing the rest: control (and
    unknown) ones as special (skipped on decode), user-defined ones (`<think>`) as plain added tokens."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind in special_types])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])


# ---------------------------------------------------------------------------------------------------------------
# gpt2: byte-level BPE

def _gguf_pre_tokenizer(pre: str | None):
    """The HF pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre` for byte-level BPE."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2's byte-level regex", pre)
    return byte_level


def _byte_level_bpe(meta: dict) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF tokenizer metadata."""
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                          fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_marked_tokens(backend, tokens, _token_types(meta), (_CONTROL,))
    return backend


# ---------------------------------------------------------------------------------------------------------------
# llama: SentencePiece, merged by score as llama.cpp does

def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best first: by the token's score (llama.cpp's
    priority), then the token's id, then where it splits.

    NOTE: llama.cpp breaks a tie between two pairs of equal score by position (leftmost first); a
    BPE rank cannot, so pairs making different tokens of equal score (rare: scores are usually
    -rank) may merge in another order than llama.cpp's where they overlap.
    """
    ranked = []
    for token_id, (token, score) in enumerate(zip(tokens, scores)):
        if vocab.get(token) != token_id:  # a duplicate spelling: llama.cpp maps the text to the last id
            continue
        for cut in range(1, len(token)):
            if token[:cut] in vocab and token[cut:] in vocab:
                ranked.append((-score, token_id, cut))
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _sentencepiece(meta: dict) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenizer as `tokenizers` BPE with byte fallback.

    llama.cpp prepends a space to every stretch of text that starts the input or follows a special
    or user-defined token, then writes spaces as '▁' (`llama_vocab::impl::tokenize`); `tokenizers`
    normalizes each stretch between added tokens alike, so the normalizer does it.
    """
    tokens, token_types = meta["tokenizer.ggml.tokens"], _token_types(meta)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    byte_fallback = _BYTE in token_types
    unk_id = meta.get("tokenizer.ggml.unknown_token_id",
                      token_types.index(_UNKNOWN) if _UNKNOWN in token_types else None)
    if not byte_fallback:
        logger.warning("GGUF SentencePiece vocabulary without <0xXX> byte tokens: characters it lacks become %s",
                       repr(tokens[unk_id]) if unk_id is not None else "nothing")
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, vocab),
                                          unk_token=tokens[unk_id] if unk_id is not None else None,
                                          fuse_unk=False, byte_fallback=byte_fallback))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.pre_tokenizer = None
    # Decoding undoes it: '▁' -> ' ', <0xXX> runs -> UTF-8, and the prefix space goes.
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    _add_marked_tokens(backend, tokens, token_types, (_CONTROL, _UNKNOWN))
    return backend
