"""/status shows what the cluster's view gives (router/view.py `instance_status`: every instance's
ranks, load and expert counts); with API keys configured it needs one (401 without, no limits
counted against it)."""
from __future__ import annotations

from fastapi.testclient import TestClient

from tests.gateway.test_api_keys import A, app, keys


def test_status_needs_a_key_where_keys_are_configured(cluster, tokenizer):
    client = TestClient(app(cluster, tokenizer, api_keys=keys()))
    r = client.get("/status")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/status", headers=A).status_code == 200
    assert client.get("/health").status_code == 200  # probes stay open
    open_client = TestClient(app(cluster, tokenizer))
    assert open_client.get("/status").status_code == 200  # no keys at all: the API is open, and so is this


def test_status_lists_the_views_rows(cluster, tokenizer):
    cluster.status_rows = [{"instance_id": "decode-0", "role": "decode", "load": {"running": 2.0}},
                           {"instance_id": "prefill-0", "role": "prefill", "load": {}}]
    assert TestClient(app(cluster, tokenizer)).get("/status").json() == {"instances": cluster.status_rows}
