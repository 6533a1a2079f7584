"""`cache_salt` (vLLM's request field) through the shared 1P1D server: prompts of one salt share their
prefix blocks, of different salts (or none) never do, as `usage.prompt_tokens_details.cached_tokens`
says; a salt that cannot work is a 400 naming it."""
from __future__ import annotations

import uuid

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)


def cached_tokens(url: str, content: str, **extra) -> int:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0, **extra}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salts_keep_prefix_caches_apart(server):
    """A fresh 80-word prompt: its second run under the same salt is served from the cache; under another
    salt, and unsalted, it is computed whole (the unsalted run's blocks then serve the unsalted one)."""
    _, url = server
    content = " ".join(f"word{i}-{uuid.uuid4().hex[:6]}" for i in range(80))
    assert cached_tokens(url, content, cache_salt="tenant-a") == 0
    assert cached_tokens(url, content, cache_salt="tenant-a") > 100
    assert cached_tokens(url, content, cache_salt="tenant-b") == 0
    assert cached_tokens(url, content) == 0
    assert cached_tokens(url, content) > 100


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7])
def test_a_salt_that_cannot_work_is_a_400_naming_it(server, salt):
    _, url = server
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert r.status_code in (400, 422) and "cache_salt" in r.text, r.text
