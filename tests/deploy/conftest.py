"""The chart rendered with each of tests/deploy/test_helm.py's value sets, shared by the chart tests."""
from __future__ import annotations

import pytest

from tests.deploy.test_helm import VALUE_SETS, manifests


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request) -> tuple[dict | None, list[dict]]:
    """(values, objects) for each value set: rendering once per module keeps the suite quick."""
    return VALUE_SETS[request.param], manifests(VALUE_SETS[request.param])
