"""Keys rotate without a restart (gateway/api_keys.py KeysFileWatcher, wired by cluster/cli/serve.py):
a keys file swapped the way a Kubernetes Secret volume swaps it is picked up by the running
gateway, a malformed one keeps the keys in use, SIGHUP reloads at once, limits carry over, and
keys too weak to take are refused where they are seen in plain text."""
from __future__ import annotations

import asyncio

import json
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cluster.cli.serve import serve_in_thread, watch_keys
from cluster.spec import ClusterSpec
from gateway.api_keys import APIKey, KeysFileWatcher, check_key_strength, hash_api_key, load_api_keys
from gateway.guard import APIKeyManager
from gateway.app import create_app

pytestmark = pytest.mark.timeout(120)
KEY_A, KEY_B = "sk-rotate-a-4f8e2c6a9b1d", "sk-rotate-b-7d3a5e9c1f0b"


def chat() -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class SecretVolume:
    """A directory laid out as kubelet lays out a Secret volume: keys.json -> ..data/keys.json,
    ..data -> a timestamped directory; `write` makes a new one and swaps the link atomically."""

    def __init__(self, root: Path):
        self.root, self.version = root, 0
        (root / "keys.json").symlink_to("..data/keys.json")

    @property
    def path(self) -> Path:
        return self.root / "keys.json"

    def write(self, text: str) -> None:
        self.version += 1
        folder = self.root / f"..2026_{self.version:02d}"
        folder.mkdir()
        (folder / "keys.json").write_text(text)
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")


def keys_file(**named: str) -> str:
    return json.dumps({"keys": [{"name": name, "sha256": hash_api_key(key)} for name, key in named.items()]})


def status(url: str, key: str) -> int:
    return httpx.post(f"{url}/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"}).status_code


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def served(cluster, tokenizer, tmp_path):
    """(volume, app, url): a gateway whose keys file (team-a) sits in a Secret-like volume."""
    volume = SecretVolume(tmp_path)
    volume.write(keys_file(**{"team-a": KEY_A}))
    app = create_app(cluster, tokenizer, "smollm2", 256, api_keys=load_api_keys(volume.path))
    url, stop = serve_in_thread(app)
    yield volume, app, url
    stop()


def test_a_swapped_keys_file_is_picked_up_without_restart(served, caplog):
    """team-a's key works and team-b's is refused; after the volume swaps in a file holding only
    team-b, the running gateway takes team-b's key and refuses team-a's, and says so naming the
    keys, never showing a key or its hash."""
    volume, app, url = served
    watcher = KeysFileWatcher(volume.path, app.state.api_keys, interval_s=0.1).start()
    try:
        assert status(url, KEY_A) == 200 and status(url, KEY_B) == 401
        with caplog.at_level(logging.INFO, logger="gateway.api_keys"):
            volume.write(keys_file(**{"team-b": KEY_B}))
            assert wait_for(lambda: status(url, KEY_B) == 200)
        assert status(url, KEY_A) == 401
    finally:
        watcher.stop()
    (line,) = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert "added team-b" in line and "removed team-a" in line
    for secret in (KEY_A, KEY_B, hash_api_key(KEY_A), hash_api_key(KEY_B)):
        assert secret not in caplog.text


def test_a_malformed_new_file_keeps_the_keys_in_use_with_one_log_line(served, caplog):
    """A new file that is not JSON, or has no keys, or is gone: the keys in use stay (team-a is
    still served) and each bad version is logged once, however often it is looked at."""
    volume, app, url = served
    watcher = KeysFileWatcher(volume.path, app.state.api_keys, interval_s=3600)
    with caplog.at_level(logging.ERROR, logger="gateway.api_keys"):
        for text in ('{"keys": [', '{"keys": []}'):
            volume.write(text)
            assert watcher.check() is False and watcher.check() is False
            assert status(url, KEY_A) == 200
        os.remove(volume.root / "..data")
        assert watcher.check() is False and status(url, KEY_A) == 200
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3 and all(e.startswith("API keys not reloaded (the 1 in use stay): api_keys_file")
                                    for e in errors), errors
    volume.write(keys_file(**{"team-a": KEY_A, "team-b": KEY_B}))
    assert watcher.check() is True and status(url, KEY_B) == 200


def test_sighup_reloads_at_once(served):
    """`pdserve gateway|serve` (watch_keys) reload on SIGHUP without waiting for the next look,
    and keep the --api-key ("default") beside the file's keys."""
    volume, app, url = served
    previous = signal.getsignal(signal.SIGHUP)
    single = "sk-single-default-9e8d7c6b"
    watcher = watch_keys(app, ClusterSpec(api_keys_file=str(volume.path)), single, interval_s=3600)  # no poll
    try:
        volume.write(keys_file(**{"team-b": KEY_B}))
        os.kill(os.getpid(), signal.SIGHUP)
        assert wait_for(lambda: status(url, KEY_B) == 200)
        assert status(url, single) == 200 and status(url, KEY_A) == 401
    finally:
        watcher.stop()
        signal.signal(signal.SIGHUP, previous)


def test_a_reload_keeps_buckets_and_in_flight_counts():
    """A key whose rate stays keeps its (empty) bucket: a reload refills no one; a changed rate gets
    a new one. A request in flight under a key that the reload removed is still released."""
    now = [0.0]
    a = APIKey("team-a", hash_api_key(KEY_A), requests_per_second=1.0, burst=1)
    b = APIKey("team-b", hash_api_key(KEY_B), max_concurrent=1)
    manager = APIKeyManager([a, b], clock=lambda: now[0])
    admit = lambda key: asyncio.run(manager.admit(key))  # noqa: E731
    admit(a)
    hold = admit(b)
    manager.replace([a])
    with pytest.raises(Exception, match="rate limit"):
        admit(a)
    asyncio.run(manager.release(hold))
    assert manager.limits.local.in_flight == {"team-a": 1, "team-b": 0}
    manager.replace([APIKey("team-a", hash_api_key(KEY_A), requests_per_second=2.0, burst=1)])
    admit(a)
    assert manager.limits.local.in_flight == {"team-a": 2}


@pytest.mark.parametrize("key, why", [("sk-short-123", "the key has 12 characters, fewer than 16"),
                                      ("sk-a sk-b-long-enough", "the key holds whitespace"),
                                      ("sk-\u00e9t\u00e9-long-enough", "the key must be printable ASCII")])
def test_a_weak_single_key_is_refused_before_anything_starts(key, why, capsys):
    """`pdserve serve --api-key` (or $PDSERVE_API_KEY) under 16 characters, or one no client could
    send, is refused in one line naming the flag, never echoing the key."""
    from cluster.cli.cli import main
    assert main(["serve", "--api-key", key]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pdserve: error: --api-key/$PDSERVE_API_KEY: {why}") and key not in line
    check_key_strength("0123456789abcdef", "here")  # 16 is enough
