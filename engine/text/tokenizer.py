"""Text <-> token ids, the chat template, and incremental detokenization for streaming.

`Tokenizer.from_path` reads either a GGUF (vocabulary, merges or scores and chat template are
metadata there; engine/text/gguf_tokenizer.py rebuilds a `tokenizers.Tokenizer` from them, byte-level BPE
or SentencePiece) or a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`, optional
`chat_template.jinja`).

`TextState`: a request's output text: incremental detokenization, stop strings, hold-back.

Text is decided in one place per serving path: the gateway for served requests (gateway/session.py),
the offline `LLM` for `pdserve generate` (decode_worker/llm.py). Workers and the router move token ids
and logprobs only; a stop string found here ends the request there (docs/architecture.md, "Text once").

The text a request has emitted lags the detokenized text by `len(longest stop string) - 1` characters,
so a stop string split across tokens is never half-streamed to the client."""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer, decoders

from engine.loading.loader import resolve_model_path
from engine.text.gguf_tokenizer import SPACE, gguf_backend, gguf_special_tokens

logger = logging.getLogger(__name__)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the rest
    are shifted to U+0100 onwards (the inverse of `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")  # a SentencePiece byte-fallback token


def _is_sentencepiece(backend: BackendTokenizer) -> bool:
    """Whether the decoder writes '▁' as a space and <0xXX> tokens as bytes (GGUF `llama`, Llama 2
    and Gemma tokenizer.json): its tokens' bytes can then be read off their spelling."""
    state = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
    return '"ByteFallback"' in state and (SPACE in state or '"Metaspace"' in state)


def _raise_exception(message: str):
    raise ValueError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` filter (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, loop controls, `raise_exception`.

    Returns:
        The template, and the variables it reads from the render call (`messages`, `tools`, ...).
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    ast = env.parse(source)
    return env.from_string(ast), frozenset(jinja2.meta.find_undeclared_variables(ast))


def _template_tool_call(call: dict, where: str) -> dict:
    """An OpenAI tool call with its `arguments` JSON string parsed: chat templates render the arguments
    with `tojson` or iterate over them, so they expect a dict (transformers' convention, as vLLM does)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {err}") from None
    return {**call, "function": function}


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: keys whose value is None dropped (an OpenAI assistant
    message with tool calls has `content: null`; templates test `'tool_calls' in message` or whether
    `message.content` is defined, as transformers does), empty `tool_calls` dropped, arguments as dicts."""
    out = []
    for i, message in enumerate(messages):
        message = {key: value for key, value in message.items() if value is not None}
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        else:
            message["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(message["tool_calls"])]
        out.append(message)
    return out


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class Tokenizer:
    """Encode, decode and chat-template rendering for one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 add_bos_token: bool, chat_template: str | None, name: str, add_eos_token: bool = False):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.set_chat_template(chat_template)
        self._name = name
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._sentencepiece = _is_sentencepiece(backend)
        self._added_ids = set(backend.get_added_tokens_decoder())

    @classmethod
    def if_any(cls, path: str | os.PathLike) -> Tokenizer | None:
        """`from_path`, or None with a warning where the model has no tokenizer: a served instance
        then streams token ids alone (stop strings and text output off)."""
        try:
            return cls.from_path(path)
        except ValueError as exc:
            logger.warning("no tokenizer for %s (%s): stop strings and text output are off", path, exc)
            return None

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a GGUF, a built-in model name, or a folder holding `tokenizer.json`."""
        folder = Path(path).expanduser()
        if folder.is_dir() and (folder / "tokenizer.json").is_file():
            return cls._from_hf_folder(folder)
        resolved = resolve_model_path(path)
        if resolved.is_dir():
            raise ValueError(f"{resolved} has no tokenizer.json")
        return cls._from_gguf(resolved)

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        from engine.quant.gguf_file import open_gguf, read_gguf_metadata  # gguf is needed for GGUF files only
        meta = read_gguf_metadata(open_gguf(path))
        special = gguf_special_tokens(meta)
        return cls(gguf_backend(meta), bos_token=special.bos_token, eos_token=special.eos_token,
                   add_bos_token=special.add_bos_token, add_eos_token=special.add_eos_token,
                   chat_template=meta.get("tokenizer.chat_template"),
                   name=meta.get("general.name") or path.stem)

    @classmethod
    def _from_hf_folder(cls, folder: Path) -> Tokenizer:
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it separately
            template = (folder / "chat_template.jinja").read_text()
        elif not template:
            template = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(BackendTokenizer.from_file(str(folder / "tokenizer.json")),
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   add_bos_token=bool(config.get("add_bos_token", False)),
                   chat_template=template, name=folder.resolve().name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens in the text (`<|im_start|>`) map to their single id.

        Args:
            add_special_tokens: run the tokenizer's post-processor and prepend BOS (append EOS) when
                the model asks for it (GGUF `tokenizer.ggml.add_bos_token`, HF `add_bos_token`).
        """
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos, eos = self.bos_token_id, self.eos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        if self.add_eos_token and eos is not None and ids[-1:] != [eos]:
            ids = ids + [eos]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at either end shows as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for; with byte-level BPE or a SentencePiece byte token that may
        be part of a UTF-8 character (which `decode([token_id])` would show as U+FFFD), and a
        SentencePiece '▁word' keeps its space (which `decode` strips). Special tokens give their text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._byte_level and token_id not in self._added_ids and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._sentencepiece and token_id not in self._added_ids:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace(SPACE, " ").encode()
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def set_chat_template(self, source: str | None) -> None:
        """Use the Jinja chat template `source` (the model's, or one given in its place: `--chat-template`)."""
        self.chat_template = source
        self._template, self.template_variables = _compile_chat_template(source) if source else (None, frozenset())

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads `tools`; one that does not would drop them silently."""
        return "tools" in self.template_variables

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render OpenAI-style `messages` with the model's chat template.

        Messages may be `{"role": "assistant", "content": None, "tool_calls": [{"id", "type": "function",
        "function": {"name", "arguments": "<JSON>"}}]}` and `{"role": "tool", "tool_call_id", "content"}`;
        the arguments reach the template parsed (a dict) and None-valued keys are left out.

        Args:
            kwargs: template variables, e.g. `tools=[{"type": "function", "function": {...}}]` (OpenAI's
                tool definitions, as they came), `enable_thinking=False` (Qwen3).
        Raises:
            ValueError: the model has no chat template, tool call arguments are not JSON, or the
                template rejects the messages.
        """
        if self._template is None:
            raise ValueError(f"model {self.name!r} has no chat template")
        return self._template.render(messages=_template_messages(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Prompt ids for a chat: the template writes any BOS itself, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text without breaking multi-byte characters.

    vLLM's technique: decode the window `ids[prefix_offset:]` and the window
    `ids[prefix_offset:read_offset]`; the text the first has beyond the second is new. If it ends in
    U+FFFD the last token(s) hold part of a UTF-8 character, so nothing is emitted until it completes.

        ids:  ... prompt tail | emitted            | not yet emitted
                              ^prefix_offset       ^read_offset       ^len(ids)

    Decoding a window (not everything) keeps each step O(window); starting the window a few tokens
    back keeps tokenizers that strip a leading space (SentencePiece) from eating it.
    """

    CONTEXT_TOKENS = 5  # prompt tokens decoded as left context

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-self.CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._text_parts)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not force):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._text_parts.append(delta)
        return delta

    def step(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they complete ("" while a character is split)."""
        self._ids.extend(new_token_ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """At the end of a sequence: emit held-back bytes too, as U+FFFD, like `decode` would."""
        return self._advance(force=True)


class TextState:
    """One output's text. `feed` tokens as they come; `take` the text that may be sent now."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 min_tokens: int = 0, skip_special_tokens: bool = True, hidden: frozenset[int] = frozenset()):
        """`hidden`: tokens that count but add no text (EOS and stop ids, where special tokens are kept
        for a tool-call parser)."""
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.hidden = hidden
        self.stops, self.min_tokens = stop, min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # detokenized output, cut at a stop string
        self.num_emitted_chars = 0
        self.num_tokens = 0  # tokens fed, up to and including the one that completed a stop string
        self.stop: str | None = None  # the stop string found; nothing is added after it

    def feed(self, token_ids: list[int]) -> int:
        """Adds new tokens, one at a time, until a stop string completes (the text is cut before it).
        Stop strings count once the output has `min_tokens` tokens (vLLM's rule), in the text then added.

        Returns how many of `token_ids` came after the stop (0 without one): tokens generated past it."""
        for i, token in enumerate(token_ids):
            if self.stop is not None:
                return len(token_ids) - i
            before = len(self.text)
            self.num_tokens += 1
            if token in self.hidden:
                continue
            self.text += self.detok.step([token])
            if self.num_tokens >= self.min_tokens:
                self._find_stop(before)
        return 0

    def _find_stop(self, before: int) -> None:
        for stop in self.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text, self.stop = self.text[:at], stop
                return

    def take(self, finished: bool) -> str:
        """The text not yet taken that may be sent: all of it once finished or stopped, else all but
        the hold-back."""
        end = len(self.text) if finished or self.stop is not None else max(self.num_emitted_chars,
                                                                          len(self.text) - self.hold)
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new
