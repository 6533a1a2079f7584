"""Fixtures the cluster tests share: a local Ray per module and a tiny random model per module."""
from __future__ import annotations

import pytest

from tests.helpers import local_ray, save_tiny_llama


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module (tests.helpers.local_ray)."""
    with local_ray():
        yield


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))
