"""The official `openai` client drives a real server: uvicorn on 127.0.0.1, SmolLM2 (fp32) on
one prefill and one decode instance in-process. Greedy outputs equal the colocated engine's."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from cluster.spec import ClusterSpec
from decode_worker.llm import LLM
from engine.request import SamplingParams
from cluster.serve import build, serve_in_thread

pytestmark = pytest.mark.timeout(300)
QUESTIONS = [f"What is {a} plus {b}?" for a, b in zip(range(2, 12), range(5, 15))]  # 10 distinct chats


@pytest.fixture(scope="module")
def server():
    spec = ClusterSpec(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=512, block_size=16,
                       max_num_seqs=128, max_num_batched_tokens=1024, num_threads=2, kv_transfer_timeout_s=30.0)
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    yield cluster, f"{url}/v1"
    stop()
    cluster.shutdown()


@pytest.fixture(scope="module")
def reference_outputs():
    """Greedy colocated outputs of the test chats, with top-3 logprobs (the in-process engine, fp32)."""
    llm = LLM(model="smollm2", dtype="float32", num_blocks=256)
    outs = llm.generate(QUESTIONS, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), chat=True)
    return {q: o for q, o in zip(QUESTIONS, outs)}


@pytest.fixture(scope="module")
def reference(reference_outputs):
    return {q: o.text for q, o in reference_outputs.items()}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def ask(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def test_chat_streamed_and_not_equal_colocated(server, reference):
    cluster, url = server
    c = client(url)
    q = QUESTIONS[0]
    r = c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=6, temperature=0)
    assert r.choices[0].message.content == reference[q] and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    chunks = list(c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reference[q]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    cluster.assert_no_leaks()


def test_chat_logprobs_equal_colocated(server, reference_outputs):
    """Logprobs through 1P1D (the first token's sampled on the prefill instance, the rest on the
    decode instance) equal the colocated engine's, streamed and not; the tokens spell the text."""
    cluster, url = server
    c = client(url)
    q = QUESTIONS[1]
    want = reference_outputs[q]
    r = c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content == want.text
    for e, wanted in zip(content, want.logprobs, strict=True):
        assert abs(e.logprob - next(iter(wanted.values()))) < 1e-3
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(sorted(wanted.values(), reverse=True)[:3],
                                                                    abs=1e-3)
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes).decode() == e.token
    chunks = list(c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    cluster.assert_no_leaks()


def test_completions_stop_and_max_tokens(server):
    c = client(server[1])
    full = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    stop = text.strip().split(" ")[1]  # a word from the middle of the greedy text
    cut = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
                               stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert streamed == text


def test_seeded_sampling_reproducible(server):
    c = client(server[1])
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95)
    a, b = (c.completions.create(seed=1234, **kw).choices[0].text for _ in range(2))
    others = {c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


def test_200_concurrent_streams_equal_colocated(server, reference):
    """200 streaming chats at once (10 distinct questions): every stream completes and equals the
    greedy colocated text; all allocators end full."""
    cluster, url = server

    async def run_all():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=250), timeout=240) as http:
            ac = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)

            async def one(q: str) -> str:
                stream = await ac.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=6,
                                                          temperature=0, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(200)]
            return qs, await asyncio.gather(*(one(q) for q in qs))
    qs, texts = asyncio.run(run_all())
    assert [t == reference[q] for q, t in zip(qs, texts)] == [True] * 200
    cluster.assert_no_leaks()


def test_disconnect_mid_stream_frees_blocks_within_a_second(server):
    cluster, url = server
    with httpx.stream("POST", f"{url}/completions", json={"model": "smollm2", "prompt": "Tell me a long story.",
                                                          "max_tokens": 400, "temperature": 0, "stream": True,
                                                          "ignore_eos": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    start = time.monotonic()
    cluster.assert_no_leaks(timeout_s=1.0)
    assert time.monotonic() - start <= 1.0


def test_status_shows_each_rank_node_and_pid(server, capsys):
    """/status and `pdserve status` give every rank's node address and process id; /status gives
    each instance's engine: the dtype, linear layers, attention backend and KV cache dtype it chose."""
    import os

    from cluster.cli import main
    cluster, url = server
    base = url.removesuffix("/v1")
    instances = httpx.get(f"{base}/status", timeout=10).json()["instances"]
    assert {i["instance_id"] for i in instances} == set(cluster.instances)
    assert all(i["ranks"] == [{"rank": 0, "node_ip": "127.0.0.1", "pid": os.getpid()}] for i in instances)
    engines = [i["engine"] for i in instances]
    assert all(e["dtype"] in ("float32", "bfloat16") and e["linear_layers"] and e["attention"] and e["kv_cache_dtype"]
               and all(isinstance(v, str) for v in e.values()) for e in engines), engines
    assert main(["status", "--url", base]) == 0
    table = capsys.readouterr().out
    assert all(f"127.0.0.1/{os.getpid()}" in line for line in table.splitlines()[1:]) and len(instances) == 2
