"""The packages keep to their floors (docs/architecture.md): import-linter's contracts (pyproject.toml)
hold, and no package reads an underscore name that only another package defines."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "router", "gateway", "cluster", "bench")


def layer_names() -> set[str]:
    """The modules that pyproject.toml's layers contracts give a floor (`a | b` and `a : b` share one)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return {name.strip() for c in contracts if c["type"] == "layers" for layer in c["layers"]
            for name in re.split(r"[|:]", layer)}


def parts(package: str) -> list[str]:
    """What stands on a floor of its own in a package split by floor (`cluster`): each subpackage and
    each module at the package's top (the leaves)."""
    root = ROOT / package
    subpackages = [d.name for d in sorted(root.iterdir()) if (d / "__init__.py").is_file()]
    modules = [f.stem for f in sorted(root.glob("*.py")) if f.name != "__init__.py"]
    return [f"{package}.{name}" for name in subpackages + modules]


def units() -> dict[str, list[Path]]:
    """The packages whose underscore names are their own, with their files: a top-level package under
    contract whole, or, for a package split by floor, each subpackage and the package's top modules."""
    found, layered = {}, layer_names()
    for package in PACKAGES:
        root = ROOT / package
        if package in layered:
            found[package] = sorted(root.rglob("*.py"))
            continue
        found[package] = sorted(root.glob("*.py"))
        for d in sorted(root.iterdir()):
            if (d / "__init__.py").is_file():
                found[f"{package}.{d.name}"] = sorted(d.rglob("*.py"))
    return found


def unit_of(module: str, names) -> str | None:
    """The unit a dotted module name belongs to: the longest unit name it starts with."""
    matches = [u for u in names if module == u or module.startswith(u + ".")]
    return max(matches, key=len, default=None)


def test_import_contracts_hold():
    """`lint-imports` (import-linter) keeps every contract: no package imports a floor above it."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is not installed (pip install -e '.[test]')"
    run = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _trees(files: list[Path]):
    for path in files:
        yield path, ast.parse(path.read_text(), str(path))


def private_names_defined(files: list[Path]) -> set[str]:
    """Underscore names a package defines: functions, classes, module globals, `self._x` attributes."""
    names = set()
    for _, tree in _trees(files):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def foreign_private_reads(unit: str, files: dict[str, list[Path]], defined: dict[str, set[str]]) -> list[str]:
    """`obj._x` and `from pkg import _x` in `unit` where only other units define `_x`."""
    own, others = defined[unit], set().union(*(v for k, v in defined.items() if k != unit))
    found = []
    for path, tree in _trees(files[unit]):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in others and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and unit_of(node.module or "", files) not in (None, unit):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
    return found


def test_no_package_reads_another_packages_underscore_names():
    """An underscore name is its package's own: the gateway reading the router's `_pending`, or one
    package importing another's `_helper`, couples them past their interface. `cluster`'s
    subpackages count as packages of their own: the command line reads none of the controller's."""
    files = units()
    defined = {u: private_names_defined(f) for u, f in files.items()}
    found = [line for u in files for line in foreign_private_reads(u, files, defined)]
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_a_violation(tmp_path, monkeypatch):
    """The check is not vacuous: a module of one package that reads another's private attribute fails
    it, and so does one subpackage importing another's underscore name."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "metrics.py").write_text("def depth(router):\n    return len(router._pending)\n")
    files = {"router": [], "gateway": [tmp_path / "gateway" / "metrics.py"]}
    assert foreign_private_reads("gateway", files, {"router": {"_pending"}, "gateway": set()}) == [
        "gateway/metrics.py:2 reads ._pending"]
    (tmp_path / "cluster" / "cli").mkdir(parents=True)
    (tmp_path / "cluster" / "cli" / "serve.py").write_text("from cluster.control.controller import _drain\n")
    files = {"cluster.control": [], "cluster.cli": [tmp_path / "cluster" / "cli" / "serve.py"]}
    assert foreign_private_reads("cluster.cli", files, {"cluster.control": {"_drain"}, "cluster.cli": set()}) == [
        "cluster/cli/serve.py:1 imports cluster.control.controller._drain"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_under_contract(package):
    """A new package must be given a floor in pyproject.toml's layers contract: a top-level package
    whole, or, when it is split by floor (`cluster`), each of its subpackages and top modules."""
    named = layer_names()
    missing = [] if package in named else [p for p in parts(package) if p not in named]
    assert not missing, f"no floor in pyproject.toml's layers contract: {missing}"
