"""The official `openai` client drives a real server: uvicorn on 127.0.0.1, SmolLM2 (fp32) on
one prefill and one decode instance in-process. Greedy outputs equal the colocated engine's."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engine.core.request import SamplingParams
from tests.helpers import all_logits

pytestmark = pytest.mark.timeout(300)
QUESTIONS = [f"What is {a} plus {b}?" for a, b in zip(range(2, 12), range(5, 15))]  # 10 distinct chats


@pytest.fixture(scope="module")
def reference_outputs(llm):
    """Greedy colocated outputs of the test chats, with top-3 logprobs (the in-process engine, fp32)."""
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


def greedy_by_formula(llm, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0, bias=None,
                      min_tokens=0) -> list[int]:
    """Greedy tokens, one at a time in plain Python: the engine's logits of the last position, then
    the written formulas (logit_bias added; EOS at -inf while the output is shorter than
    min_tokens; repetition: l / r if l > 0 else l * r over prompt and output tokens; then
    l - c * frequency - (c > 0) * presence over the output's counts c), then the argmax."""
    out = []
    for _ in range(n):
        logits = all_logits(llm.engine.runner, prompt + out, 64)[-1].tolist()
        for t, b in (bias or {}).items():
            logits[t] += b
        if len(out) < min_tokens:
            for t in llm.engine.eos_token_ids:
                logits[t] = float("-inf")
        for t in set(prompt + out):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= out.count(t) * frequency + presence
        out.append(max(range(len(logits)), key=logits.__getitem__))
        if out[-1] in llm.engine.eos_token_ids:
            break
    llm.engine.kv.reset_prefix_cache()  # all_logits wrote blocks behind its back
    return out


def test_penalties_and_logit_bias_follow_the_written_formulas(server, llm):
    """Through 1P1D (the first token sampled on the prefill instance, the rest on the decode one),
    greedy completions with presence, frequency and repetition penalties and a logit bias give the
    tokens the formulas give on the engine's logits, and not plain greedy's."""
    c, tok = client(server[1]), llm.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Italy is")
    plain = greedy_by_formula(llm, prompt, 10)
    bias = {plain[1]: -2.0}
    want = greedy_by_formula(llm, prompt, 10, presence=0.8, frequency=0.6, repetition=1.3, bias=bias)
    assert want != plain
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0, presence_penalty=0.8,
                             frequency_penalty=0.6, logit_bias={str(t): b for t, b in bias.items()},
                             extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == tok.decode(want)
    server[0].assert_no_leaks()


def test_min_tokens_holds_eos_back_on_both_instances(server, llm):
    """EOS pushed up by +100: without min_tokens the first token (the prefill's) is EOS; with
    min_tokens 3 the first three are not (the prefill's masked too), the fourth is."""
    c, tok = client(server[1]), llm.tokenizer
    prompt = tok.encode("Hello")
    eos = min(llm.engine.eos_token_ids)
    kw = dict(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    first = c.completions.create(**kw)
    assert first.choices[0].finish_reason == "stop" and first.choices[0].text == ""
    want = greedy_by_formula(llm, prompt, 8, bias={eos: 100.0}, min_tokens=3)
    assert len(want) == 4 and want[-1] == eos
    held = c.completions.create(**kw, extra_body={"min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.choices[0].text == tok.decode(want[:3])
    server[0].assert_no_leaks()


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
    """/status and `pdserve status` give every rank's node address and process id, and how it shares
    the host's CPUs (niceness, cores, intra-op threads, OpenMP wait policy); /status gives each
    instance's engine: the dtype, linear layers, attention backend and KV cache dtype it chose."""
    import os

    from cluster.cli.cli import main
    from cluster.ranks.cpu_plan import format_cpus
    cluster, url = server
    base = url.removesuffix("/v1")
    instances = httpx.get(f"{base}/status", timeout=10).json()["instances"]
    assert {i["instance_id"] for i in instances} == set(cluster.instances)
    ranks = [r for i in instances for r in i["ranks"]]
    assert [(r["rank"], r["node_ip"], r["pid"]) for r in ranks] == [(0, "127.0.0.1", os.getpid())] * 2
    cpus = format_cpus(os.sched_getaffinity(0))  # not pinned: the test process's own cores
    for r in ranks:  # in-process ranks: the test process's own priority and cores; the spec's 2 threads
        assert r["cpu"]["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) and r["cpu"]["intraop_threads"] == 2
        assert r["cpu"]["num_threads"] >= 2 and r["cpu"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY",
                                                                                                "default")
        assert r["cpu"]["cpus"] == cpus
    engines = [i["engine"] for i in instances]
    assert all(e["dtype"] in ("float32", "bfloat16") and e["linear_layers"] and e["attention"] and e["kv_cache_dtype"]
               and all(isinstance(v, str) for v in e.values()) for e in engines), engines
    assert main(["status", "--url", base]) == 0
    table = capsys.readouterr().out
    assert all(f"127.0.0.1/{os.getpid()} [nice " in line and ", 2 threads, " in line
               for line in table.splitlines()[1:]) and len(instances) == 2
