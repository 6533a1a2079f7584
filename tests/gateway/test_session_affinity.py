"""What names a request's session for the router (gateway/app.py session_of, the spec's
session_affinity): the x-session-id header; with "user", else the body's `user`; with "off", nothing."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.app import MAX_SESSION_CHARS, create_app
from tests.gateway.fakes import FakeCluster

CHAT = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("affinity, headers, user, expected", [
    ("header", {"x-session-id": "conv-1"}, None, "conv-1"),
    ("header", {}, "alice", None),  # `user` names no session unless asked to
    ("user", {}, "alice", "alice"),
    ("user", {"x-session-id": "conv-1"}, "alice", "conv-1"),  # the header first
    ("off", {"x-session-id": "conv-1"}, "alice", None),
])
def test_the_session_the_router_gets(tokenizer, affinity, headers, user, expected):
    cluster = FakeCluster()
    client = TestClient(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len,
                                   session_affinity=affinity))
    body = {**CHAT, **({"user": user} if user else {})}
    for path, payload in (("/v1/chat/completions", body),
                          ("/v1/completions", {"model": "smollm2", "max_tokens": 2, "prompt": "hi",
                                               **({"user": user} if user else {})})):
        assert client.post(path, json=payload, headers=headers).status_code == 200
    assert cluster.sessions == [expected, expected]


def test_a_long_session_name_is_cut(tokenizer):
    cluster = FakeCluster()
    client = TestClient(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    assert client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s" * 5000}).status_code == 200
    assert cluster.sessions == ["s" * MAX_SESSION_CHARS]
