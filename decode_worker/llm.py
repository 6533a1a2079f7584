"""Offline API over the colocated engine: `LLM(...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import RequestStatus, SamplingParams, choice_id
from engine.text.tokenizer import TextState
from decode_worker.engine import ColocatedEngine


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    extras: list[dict] = field(default_factory=list)  # one per token when asked (engine/core/extras.py)
    num_cached_tokens: int = 0
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def logprobs(self) -> list[dict[int, float]]:
        """One {token id: logprob} per token (the sampled token first), when the request asked."""
        return [e["logprobs"] for e in self.extras]

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token."""
        if self.first_token_s is None or self.finished_s is None or len(self.token_ids) < 2:
            return 0.0
        return (len(self.token_ids) - 1) / max(self.finished_s - self.first_token_s, 1e-9)


class LLM:
    """`LLM(model="smollm2").generate(["Hello"], SamplingParams(max_tokens=32))`.

    The offline front end: it decides the text (engine/text/tokenizer.py) and ends a request at a stop string,
    as the gateway does for served requests."""

    def __init__(self, model: str = "smollm2", dtype: str = "auto", engine: ColocatedEngine | None = None,
                 **overrides):
        if engine is None:
            cache = CacheConfig(**{k: overrides.pop(k) for k in list(overrides) if k in CacheConfig.__dataclass_fields__})
            sched = SchedulerConfig(**{k: overrides.pop(k) for k in list(overrides)
                                       if k in SchedulerConfig.__dataclass_fields__})
            engine = ColocatedEngine(EngineConfig(model=model, dtype=dtype, cache=cache, scheduler=sched, **overrides))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, and this model has none")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str | list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[CompletionOutput]:
        """Runs every prompt to completion with continuous batching; outputs keep the prompts' order
        (a prompt with n > 1 gives its n choices in a row)."""
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if self.tokenizer is None and any(sp.stop for sp in params):
            raise ValueError("stop strings need a tokenizer, and this model has none")
        outs: dict[str, CompletionOutput] = {}
        reqs = {}  # output id -> the request it comes from (a choice's: its parent, for the cached count)
        texts: dict[str, TextState] = {}
        for prompt, sp in zip(prompts, params):
            rid = f"gen-{next(self._ids)}"
            ids = self.encode(prompt, chat)
            req = self.engine.add_request(rid, ids, sp)
            for oid in [rid] if sp.n == 1 else [choice_id(rid, i) for i in range(sp.n)]:
                outs[oid], reqs[oid] = CompletionOutput(oid, ids, arrival_s=req.arrival_time), req
                if self.tokenizer is not None:
                    texts[oid] = TextState(self.tokenizer, ids, sp.stop, sp.min_tokens)
        self._run(outs, reqs, texts)
        return list(outs.values())

    def _run(self, outs: dict[str, CompletionOutput], reqs: dict, texts: dict[str, TextState]) -> None:
        while self.engine.has_unfinished():
            for o in self.engine.step():
                now = time.monotonic()
                c, text = outs.get(o.request_id), texts.get(o.request_id)
                if c is None or c.finished_s is not None:
                    continue
                if c.first_token_s is None and o.new_token_ids:
                    c.first_token_s = now
                kept = len(o.new_token_ids) - (text.feed(o.new_token_ids) if text is not None else 0)
                c.token_ids += o.new_token_ids[:kept]
                c.extras += (o.new_extras or [])[:kept]
                stopped = text is not None and text.stop is not None
                if text is not None:
                    c.text += text.take(o.finished)
                if stopped and not o.finished:  # the front end's stop string ends it in the engine too
                    self.engine.abort_request(o.request_id, RequestStatus.FINISHED_STOPPED)
                if o.finished or stopped:
                    c.finish_reason, c.finished_s = "stop" if stopped else o.finish_reason, now
                    c.num_cached_tokens = reqs[o.request_id].num_cached_tokens
