"""The chaos run's load (bench/chaos.py): client threads that send chat and completion requests
through the gateways without pause, and judge how each one ended. Most stream; a quarter do not
(some of those hung up by their client after a second or two); a tenth are long (LONG_TOKENS, the
streams a rollout's drain must carry to their end or end with an error).

Every request is greedy (temperature 0, ignore_eos), so a completed one must carry exactly the
colocated engine's text in every choice (`references`). How a request may end:
- "ok": every choice finished (a finish reason each) and equals the reference;
- "aborted": its client hung up on purpose (a random few, after a random number of chunks, or a
  non-streaming one after `hangup_after_s`);
- "error": an explicit error reached the client: an HTTP error status, an error chunk, or a
  connection refused;
- "cut": the connection closed under it with no error said. The run (bench/chaos.py) excuses it
  only when its gateway was SIGKILLed meanwhile (no process was left to say anything);
- a violation: "wrong_output" (finished, other text), "truncated" (the stream ended cleanly with
  a choice lacking a finish reason and no error), "hang" (no byte for `deadline_s`), "late"
  (ended, but past `deadline_s` after it was sent), and "cut" unless excused.
"""
from __future__ import annotations

import itertools
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "One, two, three, four,",
           "def fibonacci(n):", "Once upon a time, there was a",
           "Here is a long story about a lighthouse keeper. " * 12 + "The keeper",
           "List the planets of the solar system in order from the sun, with one fact about each: " * 4]
MAX_TOKENS = (8, 24)
LONG_TOKENS = 160  # a long stream: about 10 s on the bed's pods
KINDS = ("completion", "chat")
VIOLATIONS = ("wrong_output", "truncated", "hang", "late", "cut")


def reference_texts(model: str = "smollm2") -> dict[tuple[str, str, int], str]:
    """(kind, prompt, max_tokens) -> the colocated engine's greedy text (fp32, in this process)."""
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    llm = LLM(model=model, dtype="float32", num_blocks=256)
    refs = {}
    for kind in KINDS:
        for max_tokens in (*MAX_TOKENS, LONG_TOKENS):
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                chat=kind == "chat")
            refs.update({(kind, p, max_tokens): o.text for p, o in zip(PROMPTS, outs)})
    return refs


@dataclass
class RequestRecord:
    id: int
    kind: str
    prompt_index: int
    n: int
    max_tokens: int
    gateway: str
    abort_after_chunks: int | None
    sent_at: float
    stream: bool = True
    hangup_after_s: float | None = None  # a non-streaming client's patience (hung up on purpose)
    ended_at: float | None = None
    outcome: str | None = None  # ok, aborted, error or one of VIOLATIONS
    detail: str = ""
    texts: dict = field(default_factory=dict, repr=False)
    finish: dict = field(default_factory=dict, repr=False)

    def summary(self, t0: float) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("texts", "finish")}
        d["sent_at"] = round(self.sent_at - t0, 3)
        d["ended_at"] = None if self.ended_at is None else round(self.ended_at - t0, 3)
        return d


class Load:
    """`concurrency` client threads, each sending one request after another to a random gateway
    of `gateways()` (a callable: the set changes as pods die), with `headers`, until `stop()`."""

    def __init__(self, gateways, references: dict, concurrency: int, seed: int, deadline_s: float,
                 abort_fraction: float = 0.1, n_fraction: float = 0.2, headers: dict | None = None,
                 plain_fraction: float = 0.25, long_fraction: float = 0.1):
        self.gateways, self.references, self.deadline_s = gateways, references, deadline_s
        self.headers = headers or {}  # e.g. the API key
        self.abort_fraction, self.n_fraction = abort_fraction, n_fraction
        self.plain_fraction, self.long_fraction = plain_fraction, long_fraction  # not streamed; LONG_TOKENS
        self.records: list[RequestRecord] = []
        self._ids = itertools.count()
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self._rngs = [random.Random(seed * 1000 + i) for i in range(concurrency)]
        self._threads = [threading.Thread(target=self._client, args=(rng,), daemon=True, name=f"chaos-client-{i}")
                         for i, rng in enumerate(self._rngs)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float) -> list[str]:
        """Sends no more; waits for those in flight. Names the threads still busy past `timeout`."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _client(self, rng: random.Random) -> None:
        while not self._stopping.is_set():
            gateways = self.gateways()
            if not gateways:
                time.sleep(0.5)
                continue
            record = self._new_record(rng, *rng.choice(sorted(gateways.items())))
            with self._lock:
                self.records.append(record)
            wait_s = self._send(record, gateways[record.gateway])
            if record.outcome == "error":  # as a client would: Retry-After (at most 5 s), else 0.5 s
                self._stopping.wait(min(5.0, wait_s or 0.5))

    def _new_record(self, rng: random.Random, name: str, url: str) -> RequestRecord:
        abort = rng.randint(1, 6) if rng.random() < self.abort_fraction else None
        n = 2 if rng.random() < self.n_fraction else 1
        max_tokens = LONG_TOKENS if rng.random() < self.long_fraction else rng.choice(MAX_TOKENS)
        stream = rng.random() >= self.plain_fraction
        hangup = rng.uniform(0.5, 2.5) if not stream and abort is not None else None
        return RequestRecord(next(self._ids), rng.choice(KINDS), rng.randrange(len(PROMPTS)), n, max_tokens,
                             name, abort if stream else None, time.monotonic(), stream, hangup)

    def _send(self, r: RequestRecord, url: str) -> float | None:
        """Sends and judges `r`; the Retry-After of an error answer, if it had one."""
        prompt = PROMPTS[r.prompt_index]
        body = {"model": "smollm2", "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True, "n": r.n,
                "stream": r.stream}
        if r.kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if r.kind == "chat" else "/v1/completions"
        timeout = httpx.Timeout(r.hangup_after_s or self.deadline_s, connect=10.0)
        try:
            with httpx.stream("POST", url + path, json=body, headers=self.headers, timeout=timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._end(r, "error", f"HTTP {resp.status_code}: {resp.text[:200]}")
                    retry_after = resp.headers.get("retry-after", "")
                    return float(retry_after) if retry_after.isdigit() else None
                self._read(r, resp) if r.stream else self._read_whole(r, resp)
        except httpx.ReadTimeout:
            if r.hangup_after_s is not None:
                self._end(r, "aborted", f"not streamed, hung up after {r.hangup_after_s:.1f} s")
            else:
                self._end(r, "hang", f"no byte for {self.deadline_s:.0f} s")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # refused: the client knows
            self._end(r, "error", f"{type(exc).__name__}: {exc}"[:200])
        except httpx.HTTPError as exc:  # reset or closed under it, no error said
            self._end(r, "cut", f"{type(exc).__name__}: {exc}"[:200])
        return None

    def _read_whole(self, r: RequestRecord, resp: httpx.Response) -> None:
        """A non-streamed answer: every choice's text and finish reason at once."""
        for c in json.loads(resp.read())["choices"]:
            r.texts[c["index"]] = c["text"] if r.kind == "completion" else c["message"]["content"] or ""
            if c.get("finish_reason"):
                r.finish[c["index"]] = c["finish_reason"]
        self._judge(r, True)

    def _read(self, r: RequestRecord, resp: httpx.Response) -> None:
        chunks, done = 0, False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return self._end(r, "error", f"error chunk: {chunk['error'].get('message', '')[:200]}")
            for c in chunk.get("choices", []):
                piece = c.get("text") if r.kind == "completion" else (c.get("delta") or {}).get("content")
                r.texts[c["index"]] = r.texts.get(c["index"], "") + (piece or "")
                if c.get("finish_reason"):
                    r.finish[c["index"]] = c["finish_reason"]
            chunks += 1
            if r.abort_after_chunks is not None and chunks >= r.abort_after_chunks:
                return self._end(r, "aborted", f"after {chunks} chunks")
        self._judge(r, done)

    def _judge(self, r: RequestRecord, done: bool) -> None:
        if sorted(r.finish) != list(range(r.n)):
            return self._end(r, "truncated", f"finish reasons {r.finish} of {r.n} choices, [DONE] {done}")
        if set(r.finish.values()) != {"length"}:  # ignore_eos: only max_tokens ends a choice
            return self._end(r, "wrong_output", f"finish reasons {r.finish}, not all 'length'")
        want = self.references[(r.kind, PROMPTS[r.prompt_index], r.max_tokens)]
        wrong = {i: t for i, t in r.texts.items() if t != want}
        if wrong:
            return self._end(r, "wrong_output", f"choices {sorted(wrong)}: {next(iter(wrong.values()))!r} "
                                                f"!= {want!r}"[:300])
        self._end(r, "ok")

    def _end(self, r: RequestRecord, outcome: str, detail: str = "") -> None:
        r.ended_at = time.monotonic()
        if outcome in ("ok", "error", "aborted", "cut") and r.ended_at - r.sent_at > self.deadline_s:
            outcome, detail = "late", f"{outcome} after {r.ended_at - r.sent_at:.0f} s; {detail}"
        r.outcome, r.detail = outcome, detail

    def counts(self) -> dict[str, int]:
        with self._lock:
            records = list(self.records)
        out = {}
        for r in records:
            key = r.outcome or "in_flight"
            out[key] = out.get(key, 0) + 1
        return out
