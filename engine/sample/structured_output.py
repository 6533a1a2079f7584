"""Structured outputs (guided decoding) with llguidance: a request's output must match a grammar.

`SamplingParams.structured_output` is `(kind, spec)`:

    json_schema  spec = a JSON schema, as JSON text
    json_object  spec = "" (any JSON object)
    regex        spec = a regular expression (Rust regex syntax, which llguidance uses)
    choice       spec = a JSON list of strings: the output is exactly one of them
    grammar      spec = a Lark grammar in llguidance's dialect

Each such request has a `GrammarState` in the model runner (TP rank 0, where sampling runs). Before
each sampling step the batch's states write their token bitmasks and `apply_grammar_masks` sets every
token a row's grammar forbids to -inf, before any other logit processing (as vLLM does); after the
token is picked the runner calls `accept`. The state is rebuilt from the tokens output so far whenever
the runner first sees the request (a remote prefill, a retry elsewhere), so it needs nothing but
those tokens. A token the grammar rejects does not raise: the state is marked failed and lets only
EOS through, so the request ends. docs/structured_outputs.md has the reasoning.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_numpy  # not llguidance.torch: it imports torch._dynamo (~5 s)
import numpy as np
import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compact JSON unless the schema says otherwise ("x-guidance": {"whitespace_flexible": true}): with
# free whitespace small models often emit blank lines until max_tokens (llguidance's own default).
_JSON_DEFAULTS = {"whitespace_flexible": False}
_MAX_MESSAGE = 300


def _one_line(message: str) -> str:
    """llguidance's message on one line, without the parser-state dump a matcher error carries."""
    message = message.split("<state>", 1)[0]
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


@functools.lru_cache(maxsize=64)  # a memo: each choice of an n > 1 request, each retry, asks again
def _compile(kind: str, spec: str) -> str:
    """The llguidance grammar of `(kind, spec)`, checking only what llguidance's `grammar_from_*`
    do not (they never check validity: an `LLMatcher` built from a bad grammar is in error)."""
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    if kind == "regex":
        if not spec:
            raise ValueError("regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"choice is not valid JSON: {e}") from None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a JSON list of strings")
        if not choices:
            raise ValueError("choice list is empty")
        # Lark string literals take JSON escapes: each choice is matched literally
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        if not spec.strip():
            raise ValueError("grammar is empty")
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured output kind {kind!r} (expected one of {', '.join(KINDS)})")


def _validate(kind: str, grammar: str, tokenizer: llguidance.LLTokenizer | None) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"invalid {kind}: {_one_line(messages[0] if messages else 'llguidance refused it')}")


def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar (Lark text or its JSON form) for a request's structured output.

    Raises:
        ValueError: one line naming the problem: unknown kind, invalid JSON, a schema llguidance
            cannot compile, an empty choice list, a bad regex or Lark grammar.
    """
    grammar = _compile(kind, spec)
    _validate(kind, grammar, None)
    return grammar


def check(kind: str, spec: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Validates `(kind, spec)` fully, against the model's tokenizer (the gateway answers 400 with it).

    Raises:
        ValueError: as `grammar_of`.
    """
    _validate(kind, _compile(kind, spec), tokenizer)


@functools.lru_cache(maxsize=8)  # a memo, not state: building one reads the whole vocabulary (~0.4 s)
def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None
                 ) -> llguidance.LLTokenizer:
    """llguidance's view of our `engine.text.tokenizer.Tokenizer`, cached per (tokenizer object, sizes).

    Args:
        tokenizer: an `engine.text.tokenizer.Tokenizer` (its `tokenizers` backend is serialized for llguidance).
        vocab_size: the model's logits width; may exceed the tokenizer's (padded embeddings).
        eos_token_ids: the ids that end generation, allowed wherever the grammar may end; None = the
            tokenizer's EOS.
    """
    start = time.perf_counter()
    eos = list(eos_token_ids) if eos_token_ids else tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no EOS token: a grammar could never end")
    out = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    logger.info("structured output: llguidance tokenizer for %s (%d tokens, EOS %s) built in %.2f s",
                tokenizer.name, vocab_size, out.eos_tokens, time.perf_counter() - start)
    return out


class GrammarState:
    """One request's grammar matcher. Not thread-safe; lives in the runner next to the request's RNG.

    Built from the tokens the request has output so far, which it consumes: a request that reaches a
    new runner (after a remote prefill, a retry, a lost runner state) has the same state as if it had
    been sampled there.
    """

    def __init__(self, kind: str, spec: str, tokenizer: llguidance.LLTokenizer,
                 output_token_ids: Sequence[int] = (), request_id: str = ""):
        self.kind, self.spec, self.tokenizer, self.request_id = kind, spec, tokenizer, request_id
        self.eos_token_ids = tuple(tokenizer.eos_tokens)
        self.num_tokens = 0  # tokens given to `accept`, rejected ones included
        self.failed = False  # a rejected token or a broken grammar: only EOS is allowed from now on
        try:
            grammar = _compile(kind, spec)
        except ValueError as e:  # the gateway checks first: reaching here is a bug, not user input
            self.matcher = None
            self._fail(str(e))
        else:
            self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if self.matcher.is_error():
                self._fail(self.matcher.get_error())
        for token_id in output_token_ids:
            self.accept(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow: the grammar is complete (or failed)."""
        return self.failed or self.matcher.is_stopped()

    def _fail(self, why: str) -> None:
        self.failed = True
        logger.warning("structured output of %s failed (%s): only EOS is allowed from now on",
                       self.request_id or "a request", _one_line(why))

    def accept(self, token_id: int) -> bool:
        """Advances past the sampled token. Returns False (and the state fails) if the grammar rejects it."""
        self.num_tokens += 1
        if self.failed:
            return False
        if self.matcher.is_stopped() and token_id in self.eos_token_ids:
            return True  # EOS after the end (ignore_eos goes on): nothing to advance
        if not self.matcher.consume_token(token_id):
            self._fail(f"token {token_id} rejected: {self.matcher.get_error()}")
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]`: bit t % 32 of word t // 32 is token t.

        Shape:
            bitmask: (num_rows, ceil(vocab_size / 32)) int32, on the CPU, contiguous.
        """
        if not self.failed:
            llg_numpy.fill_next_token_bitmask(self.matcher, bitmask.numpy(), row)  # the tensor's memory
            if not self.matcher.is_error():
                return
            self._fail(self.matcher.get_error())
        bitmask[row] = 0
        for t in self.eos_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)


    def fill_bitmasks_along(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Speculative decoding: into rows first_row.. of `bitmask`, the allowed tokens at each draft's
        position and after the last, the drafts consumed while the grammar takes them, then rolled
        back (the state is as before). Returns how many drafts the grammar takes; the rows past them
        repeat the last mask (the verifier rejects a draft its mask forbids, so they are never read)."""
        n = 0 if self.failed or self.matcher.is_stopped() else self.matcher.validate_tokens(list(drafts))
        for i in range(n + 1):
            self.fill_bitmask(bitmask, first_row + i)
            if i < n:
                self.matcher.consume_token(drafts[i])
        if n:
            self.matcher.rollback(n)
        bitmask[first_row + n + 1:first_row + len(drafts) + 1] = bitmask[first_row + n]
        return n


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if k == 31 else 1 << k


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The allowed-token booleans of llguidance bitmasks, on `device`.

    On the CPU numpy's unpackbits (one C loop: about 0.2 ms for 32 rows of 49152 tokens on 2 cores,
    where the torch bit ops below took 1.5-17 ms); elsewhere the small int32 words are uploaded and
    unpacked there. llguidance's own `apply_token_bitmask_inplace` is a `torch.compile`d function
    (Triton on CUDA, a C++ toolchain and a compile per shape on the CPU), so it is not used.

    Shape:
        bitmask: (num_rows, ceil(vocab_size / 32)) int32 -> (num_rows, vocab_size) bool.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _unpack_numpy(bitmask, vocab_size)
    return _unpack_torch(bitmask.to(device, non_blocking=True), vocab_size)


def _unpack_numpy(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # little-endian words
    return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]


def _unpack_torch(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    words = bitmask.view(torch.uint8)  # (num_rows, 4 * num_words): byte b holds tokens 8b..8b+7
    # made on the device: a copy from pageable host memory would wait for the forward still running
    byte_bits = (2 ** torch.arange(8, device=bitmask.device)).to(torch.uint8)
    return ((words.unsqueeze(-1) & byte_bits) != 0).flatten(1)[:, :vocab_size]


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """In place: in each row that has a grammar, every token it does not allow becomes -inf; rows
    without one are untouched. The states are not advanced (the caller `accept`s the sampled token).

    Shape:
        logits: (num_seqs, vocab) float; len(grammars) == num_seqs. Tokens beyond the grammar
        tokenizer's vocabulary (a wider LM head) are never allowed.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    width = grammars[rows[0]].vocab_size
    assert all(grammars[i].vocab_size == width for i in rows), "one tokenizer per batch"
    bitmask = torch.from_numpy(llg_numpy.allocate_token_bitmask(len(rows), width))  # (num_rows, words) int32
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory()  # uploaded without waiting for the forward still running
    for j, i in enumerate(rows):
        grammars[i].fill_bitmask(bitmask, j)
    apply_bitmask(logits, rows, bitmask, width)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, width: int) -> None:
    """In place: in logits row rows[j], every token bitmask row j does not allow becomes -inf, and
    every token past the grammar tokenizer's `width` (a wider LM head).

    Shape:
        logits: (num_seqs, vocab) float; bitmask: (len(rows), ceil(width / 32)) int32, on the CPU.
    """
    vocab = logits.shape[-1]
    forbidden = ~unpack_bitmask(bitmask, min(width, vocab), logits.device)  # (num_rows, min(width, vocab))
    if len(rows) == logits.shape[0] and width >= vocab:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    idx = torch.tensor(rows, device=logits.device)
    sub = logits[idx]  # (num_rows, vocab)
    sub[:, :forbidden.shape[1]].masked_fill_(forbidden, float("-inf"))
    sub[:, forbidden.shape[1]:] = float("-inf")
    logits[idx] = sub
