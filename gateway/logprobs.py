"""OpenAI `logprobs` objects from the engine's per-token {token_id: logprob} maps.

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": None}                       top_logprobs: the n most likely, best first
    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
                 top_logprobs: the n most likely plus the sampled token (OpenAI: "up to logprobs+1")

Each map holds the sampled token first, then the top n (see engine/sample/sampling.py). A token's text is
its bytes decoded with U+FFFD for a partial UTF-8 character; `bytes` keeps the exact bytes.
"""
from __future__ import annotations

from engine.text.tokenizer import Tokenizer


class LogprobsFormatter:
    """Collects tokens as they stream; `take()` formats those not yet sent (one chunk's worth)."""

    def __init__(self, tokenizer: Tokenizer, kind: str, top_n: int):
        self.tokenizer, self.kind, self.top_n = tokenizer, kind, top_n
        self._pending: list[tuple[int, dict[int, float]]] = []
        self._text_offset = 0  # completions: characters of the token texts already sent
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> None:
        if logprobs is None or len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens came with {None if logprobs is None else len(logprobs)} "
                             "logprobs entries")
        self._pending += zip(token_ids, logprobs)

    def take(self) -> dict | None:
        """The logprobs object for the tokens added since the last call (None if there are none)."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        return self._chat(pending) if self.kind == "chat" else self._completion(pending)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._texts:
            raw = self.tokenizer.token_bytes(token_id)
            self._texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._texts[token_id]

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:self.top_n]

    def _chat(self, pending: list[tuple[int, dict[int, float]]]) -> dict:
        content = []
        for token_id, entry in pending:
            text, raw = self._text(token_id)
            top = [{"token": self._text(t)[0], "logprob": lp, "bytes": self._text(t)[1]} for t, lp in self._top(entry)]
            content.append({"token": text, "logprob": entry[token_id], "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _completion(self, pending: list[tuple[int, dict[int, float]]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in pending:
            text = self._text(token_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(entry[token_id])
            top = dict(self._top(entry))
            top.setdefault(token_id, entry[token_id])
            out["top_logprobs"].append({self._text(t)[0]: lp for t, lp in top.items()})
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(text)
        return out
