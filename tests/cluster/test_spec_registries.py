"""The names of the registries above the spec are declared once, in cluster/spec.py, and every registry
is built through `spec_registry`, which refuses at import one that names other ones."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from cluster.spec import CHOICES, ClusterSpec, spec_registry

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "router", "gateway", "cluster")
# spec key -> the module whose registry serves it, and the registry's name there
REGISTRIES = {"router_policy": ("router.policy", "ROUTING_POLICIES"),
              "tool_call_parser": ("gateway.tool_parsers", "TOOL_PARSERS"),
              "reasoning_parser": ("gateway.reasoning", "REASONING_PARSERS"),
              "autoscale_policy": ("cluster.autoscale.factory", "POLICIES"),
              "autoscale_actuator": ("cluster.autoscale.factory", "ACTUATORS"),
              "kv_transport": ("kvtransfer.registry", "TRANSPORTS")}


def test_spec_registry_refuses_names_the_spec_does_not_take():
    """A registry with a name missing, or one more, fails in one line naming the key and both sets."""
    with pytest.raises(RuntimeError, match="^router_policy: the registry names round_robin, the spec "
                                           "least_loaded, prefix_aware, round_robin"):
        spec_registry("router_policy", {"round_robin": object})
    extra = {name: object for name in (*CHOICES["reasoning_parser"], "granite")}
    with pytest.raises(RuntimeError, match="^reasoning_parser: the registry names deepseek_r1, granite"):
        spec_registry("reasoning_parser", extra)
    registry = spec_registry("autoscale_actuator", {name: name for name in CHOICES["autoscale_actuator"]})
    with pytest.raises(TypeError):
        registry["ray"] = "changed"  # read-only


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_each_registry_is_built_through_the_spec_names(key):
    """Each registry holds the spec's names (so each name the spec accepts is served), and its module
    builds it with spec_registry("<key>", ...), so the import-time check covers it."""
    module, name = REGISTRIES[key]
    assert set(getattr(importlib.import_module(module), name)) == set(CHOICES[key])
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    calls = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]]
    assert len(calls) == 1 and isinstance(calls[0], ast.Call) and ast.unparse(calls[0].func) == "spec_registry"
    assert ast.literal_eval(calls[0].args[0]) == key


def test_every_named_policy_and_parser_is_served():
    """Each name the spec accepts builds its object: a routing policy of that name, a parser of that name,
    an autoscaling policy."""
    from cluster.autoscale.autoscaler import Policy, ScalingLimits
    from cluster.autoscale.factory import create_policy
    from gateway.reasoning import get_reasoning_parser
    from gateway.tool_parsers import get_tool_parser
    from router.policy import create_routing_policy
    assert all(create_routing_policy(n).name == n for n in CHOICES["router_policy"])
    assert all(get_tool_parser(n).name == n for n in CHOICES["tool_call_parser"])
    assert all(get_reasoning_parser(n).name == n for n in CHOICES["reasoning_parser"])
    spec = ClusterSpec()
    for name in CHOICES["autoscale_policy"]:
        policy = create_policy(ClusterSpec(autoscale_policy=name), None, ScalingLimits.from_spec(spec))
        assert isinstance(policy, Policy)


def product_files() -> list[Path]:
    return [p for p in sorted(REPO.glob("*/**/*.py")) if p.relative_to(REPO).parts[0] in PRODUCT]


def test_no_module_copies_a_list_of_names():
    """cluster/spec.py takes the attention backends' names from engine/attention (below it) and declares the
    names of each registry above it once; no other product module spells all of one such list again."""
    tree = ast.parse((REPO / "cluster/spec.py").read_text())
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "engine.attention" for a in node.names}
    assert "ATTENTION_BACKENDS" in imported
    # a two-name list ("auto", "torch": the KV transports) is within too many others to tell a copy
    homes = {"attention_backend": REPO / "engine/attention/__init__.py"} | {key: REPO / "cluster/spec.py"
                                                                              for key in REGISTRIES
                                                                              if len(CHOICES[key]) > 2}
    copies = []
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1:
                spelled = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                copies += [f"{path.relative_to(REPO)}:{node.lineno} {key}" for key, home in homes.items()
                           if path != home and spelled >= set(CHOICES[key])]
    assert copies == []
