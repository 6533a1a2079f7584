"""Property test of the whole HTTP surface from its own OpenAPI schema: whatever schemathesis
sends (valid, boundary or malformed bodies), the gateway never answers 5xx."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from engine.loader import resolve_model_path
from engine.tokenizer import Tokenizer
from gateway.app import create_app
from tests.gateway.fakes import FakeCluster

APP = create_app(FakeCluster(), Tokenizer.from_path(resolve_model_path("smollm2")), "smollm2",
                 FakeCluster.max_model_len)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.mark.timeout(600)
@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx(case):
    response = case.call()
    assert response.status_code < 500, (case.path, case.body, response.text[:300])
