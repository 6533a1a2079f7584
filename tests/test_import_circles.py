"""No import circles among the product's modules: the graph "module A imports module B" over the
product packages, every import in a file counted (function-local and TYPE_CHECKING ones too), has
no strongly connected component of more than one module. A circle is fixed by moving the shared
definition to a lower module, a protocol, or a callable passed in; never by hiding the import."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "router", "gateway", "cluster")


def product_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product packages (a package is its __init__)."""
    mods = {}
    for package in PRODUCT:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The product module `name` lands in: itself, else its nearest enclosing package; None outside."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement names (`from pkg import name` is pkg/name.py when that exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        up = package.split(".")
        base = ".".join(up[:len(up) - (node.level - 1)] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the product modules it imports anywhere in its file. A package's __init__ importing
    its own submodules is not an edge (Python runs the package first, then the submodule)."""
    mods = product_modules(root)
    graph = {m: set() for m in mods}
    for module, path in mods.items():
        is_init = path.name == "__init__.py"
        package = module if is_init else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, mods):
                found = _resolve(target, mods)
                if found and found != module and not (is_init and found.startswith(module + ".")):
                    graph[module].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_product_has_no_import_circles():
    """Every product module's imports, function-local and TYPE_CHECKING ones included, form no circle."""
    found = circles(import_graph(ROOT))
    assert not found, "import circles:\n" + "\n".join(", ".join(c) for c in found)


def test_the_circle_check_finds_one(tmp_path):
    """The check is not vacuous: a function-local import back and a TYPE_CHECKING import each close
    a circle it reports; a package's __init__ importing its own submodule does not."""
    (tmp_path / "engine" / "runner").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "runner" / "__init__.py").write_text("from engine.runner.model import Model\n")
    (tmp_path / "engine" / "runner" / "model.py").write_text("from engine.runner import helpers\n")
    (tmp_path / "engine" / "runner" / "helpers.py").write_text("def f():\n    from engine.runner.model import Model\n")
    (tmp_path / "engine" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from engine.b import B\n")
    (tmp_path / "engine" / "b.py").write_text("from . import a\n")
    for package in PRODUCT[1:]:
        (tmp_path / package).mkdir()
    assert sorted(circles(import_graph(tmp_path))) == [["engine.a", "engine.b"],
                                                       ["engine.runner.helpers", "engine.runner.model"]]
