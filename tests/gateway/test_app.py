"""The gateway's HTTP layer over a fake cluster: OpenAI formats, validation and error bodies,
health/ready/metrics, and no 5xx for any body schemathesis can think of."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from router.tables import StreamEvent
from tests.gateway.fakes import TOKENS, FakeCluster, fake_logprobs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(cluster, tokenizer):
    return TestClient(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))


def chat(**kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Capital of France?"}], **kw}


def test_chat_completion_body_and_usage(client, cluster):
    """Usage counts the prompt, the completion and the prompt tokens a prefix cache served (OpenAI's
    `prompt_tokens_details.cached_tokens`, never more than the prompt: a retry's prompt is longer)."""
    cluster.cached_tokens = 16
    r = client.post("/v1/chat/completions", json=chat(max_tokens=3, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "The capital of"
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = len(cluster.submitted[0][1])
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3,
                             "prompt_tokens_details": {"cached_tokens": 16}}
    cluster.cached_tokens = 10_000
    r = client.post("/v1/chat/completions", json=chat(max_tokens=3, temperature=0))
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_len}


def test_completion_stream_chunks_usage_and_done(client):
    body = {"model": "smollm2", "prompt": "The", "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "The capital of France is Paris."
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 7


def test_n_choices_each_with_its_index_and_the_prompt_counted_once(client, cluster):
    r = client.post("/v1/chat/completions", json=chat(max_tokens=3, n=3))
    assert r.status_code == 200, r.text
    body, prompt_len = r.json(), len(cluster.submitted[0][1])
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and cluster.submitted[0][2].n == 3
    assert all(c["message"]["content"] == "The capital of" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 9, "total_tokens": prompt_len + 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=3, n=2, stream=True)) as r:
        chunks = [json.loads(ln[len("data: "):]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine) == "The capital of"


def test_stop_string_cuts_text(client, cluster):
    """The gateway decides the text: a stop string ends the choice at the token that completed it
    (usage counts up to it), and the request is stopped on the cluster with that token's position."""
    r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "x", "max_tokens": 10, "stop": " France"})
    assert r.json()["choices"][0]["text"] == "The capital of" and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4  # "The capital of France": the fourth completed it
    (rid, index, num_tokens), = cluster.stopped
    assert rid == r.json()["id"] and index == 0 and num_tokens == 4
    chunks = [line for line in client.post("/v1/completions", json={
        "model": "smollm2", "prompt": "x", "max_tokens": 10, "stop": " France", "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
    assert text == "The capital of" and json.loads(chunks[-1][6:])["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,status,param", [
    (chat(model="gpt-4"), 404, "model"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_tokens=10_000), 400, "max_tokens"),
    (chat(temperature=3.5), 400, "temperature"),
    (chat(presence_penalty=2.5), 400, "presence_penalty"),
    (chat(frequency_penalty=-3), 400, "frequency_penalty"),
    (chat(repetition_penalty=0), 400, "repetition_penalty"),
    (chat(min_p=1.5), 400, "min_p"),
    (chat(max_tokens=4, min_tokens=5), 400, "min_tokens"),
    (chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (chat(logit_bias={"5": 101}), 400, "logit_bias"),
    (chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    (chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (chat(n=129), 400, "n"), (chat(n=0), 400, "n"),
    (chat(top_logprobs=2), 400, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ({"model": "smollm2", "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (chat(tools=[{"type": "function"}]), 400, "tools"),
    ({"model": "smollm2", "prompt": "hi " * 300}, 400, "prompt"),
    ({"model": "smollm2", "prompt": [1, 99999999]}, 400, "prompt"),
    ({"model": "smollm2"}, 422, None),
    ({"model": "smollm2", "messages": "not a list"}, 422, None),
])
def test_bad_requests_get_openai_errors(client, cluster, body, status, param):
    """Each bad request gets its status with an OpenAI error body naming the parameter; nothing
    reaches the cluster."""
    path = "/v1/completions" if "prompt" in body or "messages" not in body and status != 422 else "/v1/chat/completions"
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    assert cluster.submitted == []


def test_sampling_controls_reach_the_cluster(client, cluster):
    """The sampling controls vLLM and OpenAI clients send are taken, as given."""
    body = chat(max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, min_tokens=2,
                min_p=0.1, logit_bias={"42": -100, "7": 2.5}, stop_token_ids=[5, 9])
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    p = cluster.submitted[0][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.min_p) == (
        0.5, -0.25, 1.3, 2, 0.1)
    assert dict(p.logit_bias) == {42: -100.0, 7: 2.5} and p.stop_token_ids == (5, 9) and p.stop_token_set == {5, 9}


def test_malformed_json_is_422(client):
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "error" in r.json()


def test_api_key(cluster, tokenizer):
    c = TestClient(create_app(cluster, tokenizer, "smollm2", 256, api_key="sekret"))
    assert c.post("/v1/chat/completions", json=chat()).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).json()["data"][0]["id"] == "smollm2"
    assert c.get("/health").status_code == 200  # probes need no key


def test_not_ready_is_503_with_retry_after(client, cluster):
    cluster.is_ready = False
    for r in (client.get("/ready"), client.post("/v1/chat/completions", json=chat())):
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "error" in r.json()


def test_queue_full_is_429(client, cluster):
    from router.router import QueueFullError

    def full(*a, **k):
        raise QueueFullError("4096 requests already queued")
    cluster.submit = full
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_metrics_health_models(client):
    client.post("/v1/chat/completions", json=chat(max_tokens=2))
    text = client.get("/metrics").text
    for name in ("pdserve_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds",
                 "pdserve_router_queue_depth"):
        assert name in text, name
    assert 'pdserve_requests_total{endpoint="chat",status="ok"} 1.0' in text
    assert "pdserve_router_retries_total 2.0" in text and "pdserve_router_instance_deaths_total 1.0" in text
    assert "pdserve_router_kv_recomputes_total 3.0" in text  # KV expected from a prefill, recomputed
    assert "pdserve_router_prompt_tokens_total 100.0" in text and "pdserve_router_cached_prompt_tokens_total 64.0" in text
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/nope").status_code == 404 and "error" in client.get("/nope").json()


def test_chat_logprobs_format(client, tokenizer):
    """Chat logprobs: one entry per token with its text, bytes and the top n, best first."""
    r = client.post("/v1/chat/completions", json=chat(max_tokens=3, logprobs=True, top_logprobs=2))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == "The capital of"
    for i, (e, t) in enumerate(zip(content, TOKENS)):
        assert e["logprob"] == fake_logprobs(i, t, 2)[t] and e["bytes"] == list(e["token"].encode())
        want = sorted(fake_logprobs(i, t, 2).items(), key=lambda kv: -kv[1])[:2]
        assert [(x["token"], x["logprob"]) for x in e["top_logprobs"]] == [
            (tokenizer.decode([tok], skip_special_tokens=False), lp) for tok, lp in want]
    r = client.post("/v1/chat/completions", json=chat(max_tokens=2, logprobs=True))
    assert [e["top_logprobs"] for e in r.json()["choices"][0]["logprobs"]["content"]] == [[], []]
    assert client.post("/v1/chat/completions", json=chat(max_tokens=2)).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_streamed(client):
    """Streamed completions logprobs: over all chunks, every token once with offsets into the text
    and top n plus the sampled token."""
    with client.stream("POST", "/v1/completions", json={"model": "smollm2", "prompt": "The", "max_tokens": 10,
                                                        "logprobs": 1, "stream": True}) as r:
        chunks = [json.loads(ln[len("data: "):]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    tokens = [t for lp in lps for t in lp["tokens"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert "".join(tokens) == text == "The capital of France is Paris."
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    tops = [top for lp in lps for top in lp["top_logprobs"]]
    assert [len(top) for top in tops] == [1 if i % 2 == 0 else 2 for i in range(len(TOKENS))]
    assert all(tok in top for tok, top in zip(tokens, tops))


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_tools_on_a_template_without_them_are_refused(client):
    """SmolLM2's own chat template never reads `tools`: they would be dropped silently, so 400."""
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "--chat-template" in r.text


def test_a_model_without_a_chat_template_serves_completions_and_refuses_chat(cluster, monkeypatch):
    """A GGUF without a chat template (the SentencePiece test files) serves /v1/completions;
    /v1/chat/completions is a 400 naming the missing template and --chat-template (tools or not,
    streamed or not), never a 500; with a template given in its place, chat works."""
    from tests.gateway import fakes
    tok = Tokenizer.from_path(Path(__file__).parents[1] / "engine" / "gguf" / "qwen2.gguf")
    assert tok.chat_template is None
    monkeypatch.setattr(fakes, "TOKENS", tok.encode("The capital of France is Paris.", add_special_tokens=False))
    c = TestClient(create_app(cluster, tok, "qwen2", FakeCluster.max_model_len))
    r = c.post("/v1/completions", json={"model": "qwen2", "prompt": "Say:", "max_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " The capital of France is Paris."
    for extra in ({}, {"stream": True}, {"tools": TOOLS}):
        r = c.post("/v1/chat/completions", json=chat(model="qwen2", **extra))
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    tok.set_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert c.post("/v1/chat/completions", json=chat(model="qwen2", max_tokens=3)).status_code == 200
    assert tok.decode(cluster.submitted[-1][1]) == "Capital of France?"


def test_auto_tool_choice_needs_a_parser(cluster):
    """With a template that renders tools but no --tool-call-parser, auto is refused; required is not."""
    tok = Tokenizer.from_path(resolve_model_path("smollm2"))
    tok.set_chat_template((Path(__file__).parent / "chat_templates" / "hermes.jinja").read_text())
    c = TestClient(create_app(cluster, tok, "smollm2", FakeCluster.max_model_len))
    r = c.post("/v1/chat/completions", json=chat(tools=TOOLS))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and "--tool-call-parser" in r.text
    r = c.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required", max_tokens=3))
    assert r.status_code == 200 and cluster.submitted[-1][2].structured_output[0] == "json_schema"


def test_a_request_an_instance_refuses_is_a_400(client, cluster, monkeypatch):
    def refuse(request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        listener(StreamEvent([], True, "error", "n=3 is more choices than this instance runs at once",
                             bad_request=True))
    monkeypatch.setattr(cluster, "submit", refuse)
    r = client.post("/v1/chat/completions", json=chat(n=3))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("n=3 is more choices")


def test_chat_template_kwargs_reach_the_template(cluster):
    tok = Tokenizer.from_path(resolve_model_path("smollm2"))
    tok.set_chat_template("{{ 'thinking:' if enable_thinking else 'plain:' }}{% for m in messages %}{{ m.content }}"
                          "{% endfor %}")
    c = TestClient(create_app(cluster, tok, "smollm2", FakeCluster.max_model_len))
    for kwargs, want in (({"enable_thinking": True}, "thinking:Capital of France?"), ({}, "plain:Capital of France?")):
        assert c.post("/v1/chat/completions", json=chat(max_tokens=2, chat_template_kwargs=kwargs)).status_code == 200
        assert tok.decode(cluster.submitted[-1][1]) == want


def test_reasoning_effort_reaches_the_template(cluster):
    """OpenAI's `reasoning_effort` is the template's variable (gpt-oss's writes it into its system
    message); one that disagrees with chat_template_kwargs, or is not low/medium/high, is a 400."""
    tok = Tokenizer.from_path(resolve_model_path("smollm2"))
    tok.set_chat_template("{{ 'effort:' + (reasoning_effort if reasoning_effort is defined else 'unset') }}")
    c = TestClient(create_app(cluster, tok, "smollm2", FakeCluster.max_model_len))
    for body, want in (({"reasoning_effort": "high"}, "effort:high"), ({}, "effort:unset"),
                       ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
                        "effort:low")):
        assert c.post("/v1/chat/completions", json=chat(max_tokens=2, **body)).status_code == 200
        assert tok.decode(cluster.submitted[-1][1]) == want
    r = c.post("/v1/chat/completions",
               json=chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert c.post("/v1/chat/completions", json=chat(reasoning_effort="extreme")).status_code in (400, 422)


def test_gpt_oss_channels_become_reasoning_and_content(cluster, monkeypatch):
    """With --reasoning-parser openai_gptoss the output is decoded with its special tokens (the
    harmony markers) and split: the analysis channel is reasoning_content, the final channel
    content, whole and streamed."""
    from tests.gateway import fakes
    tok = Tokenizer.from_path(resolve_model_path("smollm2"))
    tok.backend.add_special_tokens(["<|channel|>", "<|message|>", "<|end|>", "<|start|>"])
    text = ("<|channel|>analysis<|message|>Paris is the capital.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Paris.")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) != text and tok.decode(ids, skip_special_tokens=False) == text  # the markers are special
    monkeypatch.setattr(fakes, "TOKENS", ids)
    c = TestClient(create_app(cluster, tok, "smollm2", FakeCluster.max_model_len, reasoning_parser="openai_gptoss"))
    message = c.post("/v1/chat/completions", json=chat(max_tokens=len(ids))).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is the capital.", "Paris.")
    reasoning, content = "", ""
    with c.stream("POST", "/v1/chat/completions", json=chat(max_tokens=len(ids), stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == ("Paris is the capital.", "Paris.")
