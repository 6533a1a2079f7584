"""The official `openai` client through 1P1D (the shared server of conftest.py) on what agent and
JSON pipelines call: n > 1 choices from one prefill, structured outputs (50 random bounded JSON
schemas), and the refusals of bad ones."""
from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest

from tests.gateway.test_openai_client import ask, client

pytestmark = pytest.mark.timeout(600)


def prefill_load(cluster) -> dict[str, float]:
    (p,) = [i for i in cluster.instances.values() if i.role == "prefill"]
    return p.client.load()


def test_n_choices_from_one_prefill(server):
    """n = 3 greedy: three equal choices, each the n = 1 text; the prefill instance computes the
    prompt once (its counter grows by the prompt's tokens less its prefix-cache hits, not three
    times that); the prompt counts once in usage."""
    cluster, url = server
    c, q = client(url), "Name three colors of the rainbow, briefly."
    before, cached = prefill_load(cluster)["prefill_tokens_computed"], cluster.router.stats["cached_prompt_tokens"]
    r = c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=12, temperature=0, n=3)
    computed = prefill_load(cluster)["prefill_tokens_computed"] - before
    hits = cluster.router.stats["cached_prompt_tokens"] - cached
    assert [ch.index for ch in r.choices] == [0, 1, 2] and computed == r.usage.prompt_tokens - hits > 0
    alone = c.chat.completions.create(model="smollm2", messages=ask(q), max_tokens=12, temperature=0)
    assert [ch.message.content for ch in r.choices] == [alone.choices[0].message.content] * 3
    assert r.usage.completion_tokens == 3 * alone.usage.completion_tokens
    cluster.assert_no_leaks()


def test_seeded_choices_differ_and_reproduce_streamed(server):
    cluster, url = server
    c = client(url)
    kw = dict(model="smollm2", messages=ask("Tell me a story about a fox."), max_tokens=10, temperature=1.0,
              seed=7, n=3)
    texts = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
    streamed = ["", "", ""]
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts and len(set(texts)) == 3
    cluster.assert_no_leaks()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded JSON schema: objects with required keys, arrays with maxItems, strings with maxLength,
    enums, integers and numbers with ranges, booleans."""
    kinds = ["string", "integer", "number", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    keys = rng.sample(["name", "age", "id", "tags", "kind", "size", "ok", "meta"], rng.randint(1, 4))
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys},
            "required": rng.sample(keys, rng.randint(1, len(keys))), "additionalProperties": False}


def test_random_json_schemas_validate_whenever_they_stop(server):
    """50 random bounded schemas (objects at the top), 50 concurrent requests: every output that
    stopped parses and validates; most of them stop."""
    cluster, url = server
    rng = random.Random(16)
    schemas = [random_schema_object(rng) for _ in range(50)]

    async def run_all():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=60), timeout=500) as http:
            ac = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)

            async def one(i: int, schema: dict):
                fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
                return await ac.chat.completions.create(
                    model="smollm2", messages=ask(f"Give me a JSON object number {i}."), max_tokens=120,
                    temperature=0.7, seed=i, response_format=fmt)
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
    stopped = 0
    for schema, r in zip(schemas, asyncio.run(run_all())):
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= 40, stopped
    cluster.assert_no_leaks()


def random_schema_object(rng: random.Random) -> dict:
    keys = rng.sample(["name", "age", "id", "tags", "kind", "size", "ok", "meta"], rng.randint(1, 4))
    return {"type": "object", "properties": {k: random_schema(rng, 1) for k in keys},
            "required": rng.sample(keys, rng.randint(1, len(keys))), "additionalProperties": False}


def test_json_object_regex_and_choice(server):
    cluster, url = server
    c = client(url)
    r = c.chat.completions.create(model="smollm2", messages=ask("Describe a dog as JSON."), max_tokens=60,
                                  temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model="smollm2", prompt="The year the war ended was", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert re.fullmatch("[12][0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="smollm2", messages=ask("Is the sky blue?"), max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    cluster.assert_no_leaks()


@pytest.mark.parametrize("body,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "nothing_defined"),
])
def test_bad_formats_get_a_400_naming_the_problem(server, body, words):
    _, url = server
    r = httpx.post(f"{url}/chat/completions", json={"model": "smollm2", "messages": ask("Hi"), **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"] and r.json()["error"]["param"] in ("response_format",
                                                                                      "structured_outputs")
