"""A streamed /v1/completions request on a thread, as the multi-host tests send them."""
from __future__ import annotations

import json
import threading
import time

import httpx

from bench.chart_pods import BED_AUTH
from tests.multihost.conftest import MAX_TOKENS


class Stream:
    """One greedy streamed completion: its text, chunk times, finish reason, token count (usage)
    and error; `error` is set instead of raising (the HTTP connection cut, an error chunk)."""

    def __init__(self, url: str, prompt: str, max_tokens: int = MAX_TOKENS):
        self.prompt, self.text, self.times, self.finish_reason, self.error = prompt, "", [], None, None
        self.completion_tokens: int | None = None
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            # the chart's gateways need the bed's key; a bed server without keys ignores it
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=BED_AUTH, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self._on_chunk(json.loads(line[6:]))
        except Exception as exc:  # surfaces in the assertion, not as a thread traceback
            self.error = repr(exc)

    def _on_chunk(self, chunk: dict) -> None:
        if "error" in chunk:
            self.error = chunk["error"]["message"]
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice["text"]:
                self.text += choice["text"]
                self.times.append(time.monotonic())
            self.finish_reason = choice["finish_reason"] or self.finish_reason

    def result(self, timeout: float) -> Stream:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream for {self.prompt!r} hangs"
        return self

    def max_gap_after(self, t: float) -> float:
        """The longest wait for text after `t` (from `t` itself to the first chunk after it)."""
        after = [x for x in self.times if x > t]
        return max(b - a for a, b in zip([t] + after, after)) if after else 0.0
