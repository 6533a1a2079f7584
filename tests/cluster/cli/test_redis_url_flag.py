"""No Redis password on a command line: every local user reads it in the process list, and Ray's
job table shows a driver's command line as its entrypoint. `--redis-url` with a password is
refused in one line (the password not echoed); the URL may come from PDSERVE_REDIS_URL instead."""
from __future__ import annotations

import pytest

from cluster.cli.cli import build_parser, main
from cluster.cli import cli


@pytest.mark.parametrize("url", ["redis://pdserve:horse@10.0.0.1:6379/0", "redis://10.0.0.1:6379/0?password=horse"])
def test_a_password_in_the_redis_url_flag_is_refused_in_one_line(url, capsys):
    assert main(["gateway", "--ray-address", "127.0.0.1:1", "--redis-url", url]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pdserve: error: --redis-url redis://") and "carries a password" in line, line
    assert "horse" not in line and "PDSERVE_REDIS_PASSWORD" in line and "PDSERVE_REDIS_URL" in line


def test_the_url_comes_from_the_environment_when_the_flag_is_absent(monkeypatch):
    """PDSERVE_REDIS_URL (a Secret's key in the chart) fills the flag, never overriding it."""
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://:horse@10.0.0.1:6379/0")
    args = build_parser().parse_args(["gateway", "--ray-address", "127.0.0.1:1"])
    cli._redis_url_off_argv(args)
    assert args.redis_url == "redis://:horse@10.0.0.1:6379/0"
    args = build_parser().parse_args(["gateway", "--ray-address", "127.0.0.1:1", "--redis-url", "redis://h:1/0"])
    cli._redis_url_off_argv(args)
    assert args.redis_url == "redis://h:1/0"
    args = build_parser().parse_args(["hash-api-key"])  # no spec flags: untouched
    cli._redis_url_off_argv(args)
    assert not hasattr(args, "redis_url")
