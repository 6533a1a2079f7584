"""`pdserve bench`'s load generator: streams `POST /v1/completions` at a running server with
Poisson or fixed-rate arrivals under an optional concurrency cap, and records every request's
send, chunk and end times (the report, JSON and plots are in `cluster/loadgen/loadgen_report.py`).

    pdserve bench --url http://127.0.0.1:8000 --rate 4 --num-requests 200 --out results/

    from cluster.loadgen.loadgen import LoadConfig, run_load
    from cluster.loadgen.loadgen_report import Slo, summarize, write_outputs
    result = asyncio.run(run_load(LoadConfig(url="http://127.0.0.1:8000", rate=4.0, num_requests=200)))
    summary = summarize(result.records, Slo(ttft_s=2.0, tbt_s=0.1))
    write_outputs(result, summary, "results/")

Prompts are random token ids (exact lengths, no tokenizer needed) or come from a JSONL dataset;
every request sets `ignore_eos` so the server generates exactly `max_tokens`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import httpx
import numpy as np

TOKEN_ID_RANGE = (100, 20000)  # ordinary tokens in any vocabulary of 20k+ (no specials, no bytes)
ARRIVALS = ("poisson", "fixed")
LENGTH_DISTS = ("fixed", "uniform")


@dataclass(frozen=True)
class LoadConfig:
    """What to send, how fast and for how long; user input, so checks raise ValueError."""
    url: str = "http://127.0.0.1:8000"  # the server's root; a trailing /v1 is accepted
    model: str | None = None  # None: the first id `GET /v1/models` lists
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token
    num_requests: int | None = None  # stop after this many requests...
    duration_s: float | None = None  # ...or stop sending after this many seconds (both: whichever first)
    rate: float = math.inf  # requests/s; 0 or inf: all at once
    arrival: str = "poisson"  # gaps between arrivals: exponential ("poisson") or 1/rate ("fixed")
    concurrency: int | None = None  # at most this many requests in flight; later arrivals wait in order
    num_prompt_tokens: int = 128
    num_output_tokens: int = 128
    length_dist: str = "fixed"  # "uniform": each length drawn from [0.5, 1.5] x the value
    dataset: str | None = None  # JSONL, one {"prompt": "text" | [ids], "output_tokens": n} a line
    temperature: float = 0.0
    seed: int = 0
    request_timeout_s: float = 600.0  # the longest wait for any byte of a response
    progress: bool = True  # a tqdm bar on stderr

    def __post_init__(self):
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"the number of requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"the duration must be > 0 s, got {self.duration_s}")
        if not self.rate >= 0:
            raise ValueError(f"the rate must be >= 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"the concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and self.num_requests is None and self.unbounded_rate \
                and self.concurrency is None:
            raise ValueError("a duration with an unbounded rate sends without end: give a rate or a concurrency")
        if self.arrival not in ARRIVALS or self.length_dist not in LENGTH_DISTS:
            raise ValueError(f"arrival must be one of {ARRIVALS} and length_dist one of {LENGTH_DISTS}")
        if self.num_prompt_tokens < 1 or self.num_output_tokens < 1:
            raise ValueError("prompt and output lengths must be >= 1 token")
        if self.seed < 0:
            raise ValueError(f"the seed must be >= 0, got {self.seed}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"the request timeout must be > 0 s, got {self.request_timeout_s}")

    @property
    def unbounded_rate(self) -> bool:
        return self.rate == 0 or math.isinf(self.rate)

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    """One request's life; times are seconds from the run's start (the first arrival)."""
    index: int
    max_tokens: int
    num_prompt_tokens: int | None  # ids sent; a text prompt's count comes from the usage chunk
    arrival_s: float  # scheduled
    send_s: float | None = None  # when the request left (after waiting for a concurrency slot)
    end_s: float | None = None  # [DONE], the failure, or the error response
    chunk_s: list[float] = field(default_factory=list)  # each SSE chunk that carried text
    num_completion_tokens: int | None = None  # the usage chunk's
    finish_reason: str | None = None
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None  # why it failed; None when it succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.ok and self.chunk_s else None

    @property
    def tbt_s(self) -> float | None:
        """Mean time between tokens: first to last text chunk over the tokens after the first."""
        n = self.num_completion_tokens
        if not self.ok or not self.chunk_s or n is None or n < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.send_s if self.ok else None

    def to_dict(self) -> dict:
        return {**vars(self), "ttft_s": self.ttft_s, "tbt_s": self.tbt_s, "e2e_s": self.e2e_s}


@dataclass
class LoadResult:
    config: LoadConfig
    model: str
    started_at: float  # wall-clock time (time.time()) of the run's start
    records: list[RequestRecord]


# -- what to send and when --------------------------------------------------------------------

def arrival_times(config: LoadConfig) -> Iterator[float]:
    """Scheduled arrival times from 0, without end; the same for a given seed."""
    if config.unbounded_rate:
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng([config.seed, 0])  # its own stream: lengths do not shift arrivals
    t = 0.0
    while True:
        yield t
        t += rng.exponential(1.0 / config.rate) if config.arrival == "poisson" else 1.0 / config.rate


def load_dataset(path: str) -> list[tuple[str | list[int], int | None]]:
    """(prompt, output tokens or None) per non-blank line of a JSONL file."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the dataset: {exc}") from None
    items = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{no}: not JSON: {exc}") from None
        prompt, n = (obj.get("prompt"), obj.get("output_tokens")) if isinstance(obj, dict) else (None, None)
        good_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt or good_ids) or not (n is None or isinstance(n, int) and n >= 1):
            raise ValueError(f'{path}:{no}: want {{"prompt": "text" | [token ids], "output_tokens": n >= 1}}')
        items.append((prompt, n))
    if not items:
        raise ValueError(f"the dataset {path} has no requests")
    return items


def request_specs(config: LoadConfig) -> Iterator[RequestSpec]:
    """The requests to send, without end (a dataset repeats in file order); the same for a given seed."""
    rng = np.random.default_rng([config.seed, 1])

    def length(value: int) -> int:
        if config.length_dist == "fixed":
            return value
        return int(rng.integers(max(1, round(value * 0.5)), round(value * 1.5) + 1))

    if config.dataset is not None:
        for prompt, n in itertools.cycle(load_dataset(config.dataset)):
            yield RequestSpec(prompt, n or length(config.num_output_tokens))
    while True:
        ids = rng.integers(*TOKEN_ID_RANGE, length(config.num_prompt_tokens)).tolist()
        yield RequestSpec(ids, length(config.num_output_tokens))


# -- one request ------------------------------------------------------------------------------

def _error_message(body: bytes) -> str:
    """The OpenAI error body's message, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace").strip() or "(empty body)"


def _body(model: str, spec: RequestSpec, config: LoadConfig) -> dict:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": config.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _read_sse(resp: httpx.Response, record: RequestRecord, clock: Callable[[], float]) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            if record.num_completion_tokens is None:  # a server without usage chunks: count text chunks
                record.num_completion_tokens = len(record.chunk_s)
            return
        now = clock()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"bad SSE data: {data[:100]}"
            return
        if "error" in chunk:
            record.error = f"error event: {_error_message(data.encode())}"
            return
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                record.chunk_s.append(now)
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
        if usage := chunk.get("usage"):
            record.num_completion_tokens = usage.get("completion_tokens")
            record.num_prompt_tokens = usage.get("prompt_tokens", record.num_prompt_tokens)
    record.error = "the stream ended before [DONE]"


async def send_request(http: httpx.AsyncClient, body: dict, record: RequestRecord,
                       clock: Callable[[], float]) -> None:
    """Streams one completion into `record`; every failure ends up in `record.error`."""
    record.send_s = clock()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
            else:
                await _read_sse(resp, record, clock)
    except Exception as exc:  # a broken connection or a malformed response fails this request, not the run
        record.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    finally:
        record.end_s = clock()


# -- the run ----------------------------------------------------------------------------------

async def first_model(http: httpx.AsyncClient, base_url: str) -> str:
    try:
        resp = await http.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models: HTTP {resp.status_code}: {_error_message(resp.content)}")
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


async def _probe(http: httpx.AsyncClient, model: str, spec: RequestSpec, config: LoadConfig) -> None:
    """Sends the first request (one output token) before the clock starts, so a wrong URL, model,
    key or prompt length fails with its reason instead of as N failed requests."""
    record = RequestRecord(-1, 1, None, 0.0)
    await send_request(http, _body(model, RequestSpec(spec.prompt, 1), config), record, time.perf_counter)
    if record.status is None and record.error:
        raise ValueError(f"cannot reach {config.base_url}: {record.error}")
    if record.error:
        raise ValueError(f"the first request failed: {record.error}")


async def _drive(http: httpx.AsyncClient, model: str, specs: Iterator[RequestSpec], config: LoadConfig,
                 bar) -> list[RequestRecord]:
    """Sends each request at its arrival time (or when a concurrency slot frees), until the count
    or the duration is reached; returns once every request has ended."""
    slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    records, tasks = [], []

    async def one(record: RequestRecord, body: dict) -> None:
        try:
            await send_request(http, body, record, clock)
        finally:
            if slots:
                slots.release()
            bar.update(1)

    schedule = zip(specs, arrival_times(config))
    for i, (spec, at) in enumerate(itertools.islice(schedule, config.num_requests)):
        if config.duration_s is not None and at >= config.duration_s:
            break
        if (delay := at - clock()) > 0:
            await asyncio.sleep(delay)
        if slots:
            await slots.acquire()
        if config.duration_s is not None and clock() >= config.duration_s:
            if slots:
                slots.release()
            break
        prompt_len = len(spec.prompt) if isinstance(spec.prompt, list) else None
        records.append(record := RequestRecord(i, spec.max_tokens, prompt_len, at))
        tasks.append(asyncio.create_task(one(record, _body(model, spec, config))))
    await asyncio.gather(*tasks)
    return records


async def run_load(config: LoadConfig) -> LoadResult:
    """Runs the load described by `config` against its server.

    Raises:
        ValueError: the server cannot be reached, lists no model, or refuses the first request.
    """
    from tqdm import tqdm
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # One connection per in-flight request, so httpx's pool never queues a request the cap let through.
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(10.0, config.request_timeout_s))
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits, timeout=timeout) as http:
        model = config.model or await first_model(http, config.base_url)
        specs = request_specs(config)
        first = next(specs)
        await _probe(http, model, first, config)
        started_at = time.time()
        with tqdm(total=config.num_requests, unit="req", file=sys.stderr, disable=not config.progress,
                  desc="bench") as bar:
            records = await _drive(http, model, itertools.chain([first], specs), config, bar)
    return LoadResult(config, model, started_at, records)


# -- the command line -------------------------------------------------------------------------

def add_flags(g) -> None:
    """The load generator's flags, on a parser or an argument group (names avoid the spec flags')."""
    g.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model to ask for (default: the first of /v1/models)")
    g.add_argument("--client-api-key", metavar="KEY", default=None,
                   help="bearer token to send (default: $PDSERVE_API_KEY)")
    g.add_argument("--num-requests", type=int, metavar="N", default=None,
                   help="requests to send (default: 100 without --duration)")
    g.add_argument("--duration", type=float, metavar="S", default=None, help="stop sending after S seconds")
    g.add_argument("--rate", type=float, metavar="R", default=math.inf,
                   help="requests/s; 0 or inf: all at once (default: inf)")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="gaps between arrivals (default: poisson)")
    g.add_argument("--concurrency", type=int, metavar="N", default=None,
                   help="cap on requests in flight (default: none)")
    g.add_argument("--prompt-tokens", type=int, metavar="N", default=128, help="prompt length (default: 128)")
    g.add_argument("--output-tokens", type=int, metavar="N", default=128, help="output length (default: 128)")
    g.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed",
                   help="uniform: lengths drawn from 0.5x..1.5x (default: fixed)")
    g.add_argument("--dataset", metavar="FILE.jsonl", default=None,
                   help='{"prompt": "text" | [ids], "output_tokens": n} per line, repeated in order')
    g.add_argument("--temperature", type=float, metavar="T", default=0.0, help="(default: 0, greedy)")
    g.add_argument("--seed", type=int, metavar="N", default=0,
                   help="prompts, lengths and Poisson arrivals (default: 0)")
    g.add_argument("--ttft-slo", type=float, metavar="S", default=None, help="goodput: time to first token <= S")
    g.add_argument("--tbt-slo", type=float, metavar="S", default=None, help="goodput: time between tokens <= S")
    g.add_argument("--request-timeout", type=float, metavar="S", default=600.0,
                   help="a request fails after S seconds without a byte (default: 600)")
    g.add_argument("--out", metavar="DIR", default=None, help="write DIR/result.json and the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args) -> LoadConfig:
    num_requests = 100 if args.num_requests is None and args.duration is None else args.num_requests
    return LoadConfig(url=args.url, model=args.served_model_name,
                      api_key=args.client_api_key or os.environ.get("PDSERVE_API_KEY"),
                      num_requests=num_requests, duration_s=args.duration, rate=args.rate, arrival=args.arrival,
                      concurrency=args.concurrency, num_prompt_tokens=args.prompt_tokens,
                      num_output_tokens=args.output_tokens, length_dist=args.length_dist, dataset=args.dataset,
                      temperature=args.temperature, seed=args.seed, request_timeout_s=args.request_timeout,
                      progress=not args.no_progress)
