"""What `pip install .` installs: the product's packages, whole, and not bench/ (a dev-only folder run
with `python -m bench.*` from a checkout). Read from pyproject.toml's package finding, as setuptools
does, without building a wheel."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, find_packages

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def installed_packages() -> set[str]:
    """The packages setuptools puts in the wheel, from [tool.setuptools.packages.find]."""
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return {pkg for where in find.get("where", ["."])
            for pkg in finder(str(REPO / where), include=find.get("include", ("*",)), exclude=find.get("exclude", ()))}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, function-local imports included."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}


def test_the_wheel_holds_the_product_and_not_bench():
    """Every root package of the import contracts but bench is installed, with each of its subpackages;
    bench/ and tests/ are not."""
    packages = installed_packages()
    roots = set(PYPROJECT["tool"]["importlinter"]["root_packages"])
    assert {p.split(".")[0] for p in packages} == roots - {"bench"}
    for root in roots - {"bench"}:
        on_disk = {".".join(d.relative_to(REPO).parts) for d in (REPO / root).rglob("*")
                   if (d / "__init__.py").is_file()} | {root}
        assert on_disk <= packages, sorted(on_disk - packages)


def test_installed_code_imports_only_installed_packages():
    """No installed module imports bench (or any of our packages left out of the wheel): `pdserve bench`
    is the load generator in cluster/loadgen, the benchmarks' own code stays in the checkout."""
    packages = installed_packages()
    ours = set(PYPROJECT["tool"]["importlinter"]["root_packages"])
    missing = []
    for package in sorted(packages):
        for path in sorted((REPO / package.replace(".", "/")).glob("*.py")):
            missing += [f"{path.relative_to(REPO)} imports {m}" for m in sorted(imports_of(path))
                        if m.split(".")[0] in ours and m.split(".")[0] not in {p.split(".")[0] for p in packages}]
    assert missing == []
