"""Every test here runs under one fixed cluster secret (kvtransfer/wire.py), so a receiver in a
spawned child process and a sender in the test's process agree whichever of them first needs
it; test_auth.py changes it where a test needs another."""
from __future__ import annotations

import pytest

from kvtransfer.wire import SECRET_ENV


@pytest.fixture(autouse=True)
def _cluster_secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "kvtransfer-tests-secret-0123456789abcdef")
