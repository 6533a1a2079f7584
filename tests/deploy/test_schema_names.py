"""The Helm chart's values.schema.json offers exactly the names the registries behind each key serve:
a name a registry lacks would pass `helm install` and fail in the pod; one the schema lacks could not
be set from the chart."""
from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from cluster.autoscale.factory import POLICIES as AUTOSCALE_POLICIES
from cluster.spec import CHOICES, ClusterSpec
from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.core.config import DTYPE_CHOICES, EXPERT_METHOD_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from engine.core.speculative_config import METHODS as SPECULATIVE_METHODS
from gateway.reasoning import REASONING_PARSERS
from gateway.tool_parsers import TOOL_PARSERS
from router.policy import ROUTING_POLICIES

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "deploy/helm/pdserve/values.schema.json").read_text())
SPEC = SCHEMA["properties"]["spec"]["properties"]
# spec key -> the names its registry (or the engine's list) serves, read from the registry itself
REGISTRIES = {
    "router_policy": ROUTING_POLICIES, "attention_backend": ATTENTION_BACKENDS, "tool_call_parser": TOOL_PARSERS,
    "reasoning_parser": REASONING_PARSERS, "speculative_method": SPECULATIVE_METHODS, "dtype": DTYPE_CHOICES,
    "quantization": QUANTIZATION_CHOICES, "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES,
    "expert_method": EXPERT_METHOD_CHOICES,
}


def enum_names(prop: dict) -> set[str]:
    return {name for name in prop["enum"] if name is not None}


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_schema_enum_is_the_registrys_names(key):
    """values.spec.<key> takes exactly its registry's names, and null exactly where the key is optional."""
    assert enum_names(SPEC[key]) == set(REGISTRIES[key])
    optional = type(None) in typing.get_args(typing.get_type_hints(ClusterSpec)[key])
    assert (None in SPEC[key]["enum"]) == optional


def test_autoscaler_policy_enum_is_the_factorys_names():
    """values.autoscaler.policy (the chart writes it into autoscale_policy) names the autoscaler's policies."""
    assert set(SCHEMA["properties"]["autoscaler"]["properties"]["policy"]["enum"]) == set(AUTOSCALE_POLICIES)


def test_every_spec_key_with_choices_has_its_enum():
    """A spec key with a fixed set of names is an enum in the schema (not any string) holding those names:
    all of them, but for `mode`, where the chart runs disaggregated pools only."""
    for key in set(CHOICES) & set(SPEC):
        names = set(CHOICES[key])
        assert enum_names(SPEC[key]) <= names if key == "mode" else enum_names(SPEC[key]) == names, key
