"""Fixtures the cluster tests share: a local Ray per module and a tiny random model per module."""
from __future__ import annotations

import pytest

from cluster.control.cluster import setup_ray_auth
from tests.helpers import save_tiny_llama


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module, token auth on (a fresh token, nothing written to ~/.ray)."""
    setup_ray_auth()
    import ray
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))
