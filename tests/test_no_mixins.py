"""No mixins in the product (HOUSE_STYLE 29): a class of ours that another of our classes inherits
from defines every attribute it reads on `self`: assigned in its methods, declared in its body, or
defined by one of our classes above it. A class too big for one file holds objects instead
(docs/architecture.md, "Objects held, not mixins")."""
from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

from tests.test_import_circles import PRODUCT, ROOT


def _classes(root: Path) -> list[tuple[str, ast.ClassDef]]:
    """(module, definition) of every class of the product packages."""
    found = []
    for package in PRODUCT:
        for path in (root / package).rglob("*.py"):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            tree = ast.parse(path.read_text(), str(path))
            found += [(module, n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return found


def _external(module: str, name: str) -> set[str]:
    """What the class gets from bases not of ours (torch's Module, pydantic's BaseModel): imported
    to ask them. A class in a module that cannot be imported here (a test's tree) gets nothing."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return set()
    return {attr for k in cls.__mro__ if k.__module__.split(".")[0] not in PRODUCT for attr in dir(k)}


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))]


def _defined(cls: ast.ClassDef) -> set[str]:
    """What the class itself defines: its body's names and every `self.x` it assigns."""
    names = set()
    dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                node.value is not None or dataclass):  # a bare annotation promises, it does not define
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):  # setattr(self, name, ...) over a literal tuple of names
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)) and any(
                isinstance(c, ast.Call) and getattr(c.func, "id", None) == "setattr" for c in ast.walk(node)):
            names |= {e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def _read(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and isinstance(n.ctx, ast.Load)}


def mixins(root: Path) -> dict[str, list[str]]:
    """Class -> the attributes it reads but neither it nor our classes above it define, for every
    class of ours that one of ours inherits from."""
    defs = _classes(root)
    named: dict[str, list] = {}
    for module, cls in defs:
        named.setdefault(cls.name, []).append((module, cls))
    classes = {name: found[0] for name, found in named.items() if len(found) == 1}  # bases match by name
    inherited = {b for _, cls in defs for b in _base_names(cls) if b in classes}

    def defined_above(name: str, seen=()) -> set[str]:
        module, cls = classes[name]
        out = _defined(cls) | _external(module, name)
        for base in _base_names(cls):
            if base in classes and base not in seen:
                out |= defined_above(base, (*seen, name))
        return out
    found = {}
    for name in sorted(inherited):
        missing = _read(classes[name][1]) - defined_above(name) - set(dir(builtins)) - set(dir(object))
        if missing:
            found[name] = sorted(missing)
    return found


def test_no_class_of_ours_that_others_inherit_uses_attributes_it_does_not_define():
    assert mixins(ROOT) == {}


def test_the_check_finds_a_mixin(tmp_path):
    """The negative control: a base that reads what only its subclass sets is found."""
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "mixed.py").write_text(
        "class Retry:\n    def again(self):\n        return self.tables\n\n"
        "class Router(Retry):\n    def __init__(self):\n        self.tables = {}\n")
    assert mixins(tmp_path) == {"Retry": ["tables"]}
