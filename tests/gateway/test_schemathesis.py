"""Property test of the whole HTTP surface from its own OpenAPI document, over a fake cluster:
whatever schemathesis sends (valid, boundary or malformed bodies), the gateway never answers
5xx, and every conformance check holds: each status and content type it answers is declared,
with the declared headers and body; bodies the document rules out are refused, and bodies it
allows are taken. One allowance: a schema-valid body may still get a 400 when its token counts
do not fit (max_tokens past the context left by the tokenized prompt, a token id past the
vocabulary), which no JSON schema can state."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from tests.gateway.fakes import FakeCluster

APP = create_app(FakeCluster(), Tokenizer.from_path(resolve_model_path("smollm2")), "smollm2",
                 FakeCluster.max_model_len)
CONFIG = SchemathesisConfig.from_dict({"output": {"sanitization": {"enabled": False}},
                                       "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400"]}}})
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)


@pytest.mark.timeout(600)
@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_conformance_check_holds(case):
    case.call_and_validate()


def test_the_document_names_the_served_model_and_every_status():
    doc = APP.openapi()
    body = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert body["properties"]["model"]["enum"] == ["smollm2"] and body["additionalProperties"] is False
    statuses = set(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert statuses == {"200", "400", "401", "404", "413", "422", "429", "503"}
    assert set(doc["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "429"}  # a key's limits too
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
