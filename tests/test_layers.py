"""The packages keep to their floors (docs/architecture.md): import-linter's contracts (pyproject.toml)
hold, and no package reads an underscore name that only another package defines."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "router", "gateway", "cluster", "bench")


def test_import_contracts_hold():
    """`lint-imports` (import-linter) keeps every contract: no package imports a floor above it."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is not installed (pip install -e '.[test]')"
    run = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _trees(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def private_names_defined(package: str) -> set[str]:
    """Underscore names a package defines: functions, classes, module globals, `self._x` attributes."""
    names = set()
    for _, tree in _trees(package):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def foreign_private_reads(package: str, defined: dict[str, set[str]]) -> list[str]:
    """`obj._x` and `from pkg import _x` in `package` where only other packages define `_x`."""
    own, others = defined[package], set().union(*(v for k, v in defined.items() if k != package))
    found = []
    for path, tree in _trees(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in others and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                if node.module.split(".")[0] != package:
                    found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")]
    return found


def test_no_package_reads_another_packages_underscore_names():
    """An underscore name is its package's own: the gateway reading the router's `_pending`, or one
    package importing another's `_helper`, couples them past their interface."""
    defined = {p: private_names_defined(p) for p in PACKAGES}
    found = [line for p in PACKAGES for line in foreign_private_reads(p, defined)]
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_a_violation(tmp_path, monkeypatch):
    """The check is not vacuous: a module of one package that reads another's private attribute fails it."""
    fake = {"router": {"_pending"}, "gateway": set()}
    src = tmp_path / "gateway"
    src.mkdir()
    (src / "metrics.py").write_text("def depth(router):\n    return len(router._pending)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert foreign_private_reads("gateway", fake) == ["gateway/metrics.py:2 reads ._pending"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_under_contract(package):
    """A new top-level package must be given a floor in pyproject.toml's layers contract."""
    assert f'"{package}"' in (ROOT / "pyproject.toml").read_text().split("[tool.importlinter]")[1]
