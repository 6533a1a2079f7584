"""Redis credentials and TLS of the cluster state (cluster/redis_client.py), against a real
redis-server with an ACL file like the chart's: `default` off, one user with a hashed password."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import redis_client
from cluster.redis_client import RedisAuthError, connection_options, mask_url
from cluster.redis_state import RedisState
from cluster.state import InstanceRecord
from tests.conftest import _free_port, stop_server

pytestmark = pytest.mark.timeout(120)

USER, PASSWORD = "pdserve", "correct horse battery staple"
ENV = ("PDSERVE_REDIS_USERNAME", "PDSERVE_REDIS_PASSWORD", "PDSERVE_REDIS_PASSWORD_FILE", "PDSERVE_REDIS_CA_FILE")
REPO = Path(__file__).resolve().parents[2]


def acl_file(path: Path, user: str, password: str) -> Path:
    """The chart's ACL (templates/_helpers.tpl pdserve.redisAcl): `default` off, `user` with the
    password's SHA-256, every command but @dangerous."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    path.write_text(f"user default off\nuser {user} on #{digest} ~* &* +@all -@dangerous +acl|log\n")
    return path


def start_redis_server(workdir: Path, *args: str, port_flag: str = "--port") -> tuple[subprocess.Popen, int]:
    """redis-server with `args` on a free loopback port (`port_flag`: --tls-port for TLS, with
    `--port 0` in args), no persistence, waited for until the port accepts connections (after
    the ACL file is loaded). Skips when the binary is missing, as tests/conftest.py's does."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    for _ in range(3):  # the free port may be taken between probing and binding: retry
        port = _free_port()
        log = open(workdir / f"redis-{port}.log", "w")
        proc = subprocess.Popen([binary, *args, port_flag, str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir)], cwd=workdir, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.05)
        stop_server(proc)
    raise RuntimeError(f"redis-server did not start: {(workdir / f'redis-{port}.log').read_text()[-2000:]}")


def exercise_state(state: RedisState) -> None:
    """Every command the cluster state sends (Lua scripts, pipelines, SCAN, sorted sets), once:
    whatever the ACL forbids among them raises here."""
    record = InstanceRecord("auth-0", "decode", 1, [("10.0.0.1", 5000)], "healthy", {"running": 1.0})
    state.register(record)
    state.heartbeat("auth-0", 5.0)
    state.update_load("auth-0", {"running": 2.0})
    state.set_health("auth-0", "draining")
    assert [r.load["running"] for r in state.list_instances()] == [2.0] and not state.expired_instances()
    state.record_metric("ttft", 0.5)
    assert [v for _, v in state.recent_metrics("ttft", 60)] == [0.5]
    state.publish_router("gw", {"queued": 1.0}, ttl_s=5.0)
    assert state.router_stats() == {"gw": {"queued": 1.0}}
    state.remove("auth-0")
    assert state.get("auth-0") is None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Each test starts with none of the PDSERVE_REDIS_* variables (they may be set around the suite)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory) -> str:
    """URL of a redis-server admitting only USER with PASSWORD (no credentials in the URL)."""
    workdir = tmp_path_factory.mktemp("redis-acl")
    proc, port = start_redis_server(workdir, "--aclfile", str(acl_file(workdir / "users.acl", USER, PASSWORD)))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_server(proc)


def test_password_from_env_admits_the_state(acl_redis, monkeypatch):
    """With the ACL user and its password from the environment, the cluster state works: every
    command it sends is allowed by the chart's ACL (all but @dangerous)."""
    monkeypatch.setenv("PDSERVE_REDIS_USERNAME", USER)
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    state = RedisState(acl_redis, namespace="auth-env")
    try:
        exercise_state(state)
    finally:
        state.close()


def test_password_file_admits_the_state(acl_redis, monkeypatch, tmp_path):
    """PDSERVE_REDIS_PASSWORD_FILE (a mounted Secret key, here with a trailing newline) works as
    the variable does; the username may also come in the URL."""
    (tmp_path / "password").write_text(PASSWORD + "\n")
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD_FILE", str(tmp_path / "password"))
    state = RedisState(acl_redis.replace("redis://", f"redis://{USER}@"), namespace="auth-file")
    try:
        state.record_metric("x", 1.0)
        assert [v for _, v in state.recent_metrics("x", 60)] == [1.0]
    finally:
        state.close()


def test_password_in_the_url_is_masked_in_logs(acl_redis, caplog):
    """A password in the URL works, and the log line naming the Redis shows it as ***."""
    url = acl_redis.replace("redis://", f"redis://{USER}:{PASSWORD.replace(' ', '%20')}@")
    with caplog.at_level(logging.INFO, logger=redis_client.__name__):
        RedisState(url, namespace="auth-url").close()
    assert f"{USER}:***@127.0.0.1" in caplog.text
    assert "horse" not in caplog.text


@pytest.mark.parametrize("user, password, message", [
    (None, None, "requires a password: set PDSERVE_REDIS_USERNAME and PDSERVE_REDIS_PASSWORD"),
    (USER, "wrong horse", "refused the password of user 'pdserve'"),
    (None, PASSWORD, "refused the password of user 'default'"),  # the default user is off
], ids=["none", "wrong", "default-user"])
def test_refused_password_is_one_clear_line(acl_redis, monkeypatch, user, password, message):
    """Without the password, with a wrong one, or as the (disabled) default user: one line that
    names Redis, its masked URL and what was refused; never the password itself."""
    if user:
        monkeypatch.setenv("PDSERVE_REDIS_USERNAME", user)
    if password:
        monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", password)
    with pytest.raises(RedisAuthError, match=message) as refused:
        RedisState(acl_redis)
    text = str(refused.value)
    assert text.startswith(f"Redis at {acl_redis} ") and "\n" not in text and "horse" not in text
    assert isinstance(refused.value, ValueError)  # what `pdserve` prints as one line


def test_cli_prints_a_refused_password_as_one_line(acl_redis):
    """`pdserve gateway` with a wrong password exits 2 with one error line naming Redis, no traceback."""
    env = {**{k: v for k, v in os.environ.items() if k not in ENV}, "OMP_NUM_THREADS": "1",
           "PDSERVE_REDIS_USERNAME": USER, "PDSERVE_REDIS_PASSWORD": "wrong horse"}
    out = subprocess.run([sys.executable, "-m", "cluster.cli.cli", "--log-level", "WARNING", "gateway",
                          "--ray-address", "127.0.0.1:1", "--redis-url", acl_redis],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "horse" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"pdserve: error: Redis at {acl_redis} refused the password of user 'pdserve' "
        "(invalid username-password pair or user is disabled.)")


def test_unreachable_redis_is_one_line():
    """Nothing listening: one ValueError line naming Redis and the masked URL."""
    url = f"redis://{USER}:secret@127.0.0.1:{_free_port()}/0"
    with pytest.raises(ValueError, match=rf"^cannot reach Redis at redis://{USER}:\*\*\*@127\.0\.0\.1") as err:
        RedisState(url)
    assert "secret" not in str(err.value)


@pytest.mark.parametrize("url, masked", [
    ("redis://u:p%40ss@host:6379/0", "redis://u:***@host:6379/0"),
    ("redis://:pass@host:6379", "redis://:***@host:6379"),
    ("rediss://u:pass@[::1]:6380/2", "rediss://u:***@[::1]:6380/2"),
    ("redis://u@host:6379/0", "redis://u@host:6379/0"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///run/redis.sock?db=1&password=pass", "unix:///run/redis.sock?db=1&password=***"),
])
def test_mask_url(url, masked):
    """A password in the user-info or the query becomes ***; the rest of the URL stays readable."""
    assert mask_url(url) == masked


def test_connection_options_map_the_environment(tmp_path):
    """User, password (or its file) and CA file become redis-py's username, password and ssl_ca_certs."""
    (tmp_path / "ca.pem").write_text("-")
    (tmp_path / "pw").write_text("s3cret\r\n")
    assert connection_options("redis://h:1/0", {}) == {}
    env = {"PDSERVE_REDIS_USERNAME": "u", "PDSERVE_REDIS_PASSWORD_FILE": str(tmp_path / "pw"),
           "PDSERVE_REDIS_CA_FILE": str(tmp_path / "ca.pem")}
    assert connection_options("rediss://h:1/0", env) == {"username": "u", "password": "s3cret",
                                                         "ssl_ca_certs": str(tmp_path / "ca.pem")}
    assert connection_options("redis://u:p@h:1/0", {}) == {}  # redis-py reads the URL's own


@pytest.mark.parametrize("url, env, message", [
    ("redis://h:1", {"PDSERVE_REDIS_PASSWORD": "a", "PDSERVE_REDIS_PASSWORD_FILE": "f"}, "not both"),
    ("redis://h:1", {"PDSERVE_REDIS_PASSWORD": ""}, "PDSERVE_REDIS_PASSWORD is set but empty"),
    ("redis://h:1", {"PDSERVE_REDIS_USERNAME": "u"}, "PDSERVE_REDIS_USERNAME=u needs PDSERVE_REDIS_PASSWORD"),
    ("redis://u:p@h:1", {"PDSERVE_REDIS_PASSWORD": "p"}, r"redis://u:\*\*\*@h:1 carries a password"),
    ("redis://u@h:1", {"PDSERVE_REDIS_USERNAME": "v", "PDSERVE_REDIS_PASSWORD": "p"}, "names a user"),
    ("redis://h:1", {"PDSERVE_REDIS_PASSWORD_FILE": "/nonexistent/pw"}, "PDSERVE_REDIS_PASSWORD_FILE=/nonexistent/pw"),
    ("redis://h:1", {"PDSERVE_REDIS_PASSWORD_FILE": "EMPTY"}, "is empty"),
    ("redis://h:1", {"PDSERVE_REDIS_CA_FILE": "CA"}, "the Redis URL must be rediss://"),
    ("rediss://h:1", {"PDSERVE_REDIS_CA_FILE": "/nonexistent/ca.pem"}, "CA_FILE=/nonexistent/ca.pem is not a file"),
], ids=["password-twice", "empty", "user-without-password", "url-and-env-password", "url-and-env-user",
        "missing-file", "empty-file", "ca-without-tls", "missing-ca"])
def test_connection_options_refuse_what_cannot_work(tmp_path, url, env, message):
    """Each value that cannot work is refused with one line naming it (and never the password)."""
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "ca.pem").write_text("-")
    paths = {"EMPTY": str(tmp_path / "empty"), "CA": str(tmp_path / "ca.pem")}
    env = {k: paths.get(v, v) for k, v in env.items()}
    with pytest.raises(ValueError, match=message) as err:
        connection_options(url, env)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> tuple[str, Path]:
    """(rediss:// URL, CA file) of a TLS-only redis-server with the ACL, its certificate
    self-signed (openssl) for 127.0.0.1. Skips, saying why, without openssl or TLS in redis-server."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a self-signed certificate")
    workdir = tmp_path_factory.mktemp("redis-tls")
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    try:
        proc, port = start_redis_server(workdir, "--port", "0", "--tls-cert-file", str(cert), "--tls-key-file",
                                        str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                                        "--aclfile", str(acl_file(workdir / "users.acl", USER, PASSWORD)),
                                        port_flag="--tls-port")
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS: {exc}")
        raise
    try:
        yield f"rediss://127.0.0.1:{port}/0", cert
    finally:
        stop_server(proc)


def test_tls_with_the_ca_file(tls_redis, monkeypatch):
    """rediss:// with PDSERVE_REDIS_CA_FILE verifies the server and logs in: the state works over TLS."""
    url, ca = tls_redis
    monkeypatch.setenv("PDSERVE_REDIS_USERNAME", USER)
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("PDSERVE_REDIS_CA_FILE", str(ca))
    state = RedisState(url, namespace="auth-tls")
    try:
        exercise_state(state)
    finally:
        state.close()


def test_tls_without_the_ca_is_one_line(tls_redis, monkeypatch):
    """Without the CA the self-signed server fails verification: one line naming Redis, not a traceback."""
    url, _ = tls_redis
    monkeypatch.setenv("PDSERVE_REDIS_USERNAME", USER)
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", PASSWORD)
    with pytest.raises(ValueError, match=rf"cannot reach Redis at {url}: .*CERTIFICATE_VERIFY_FAILED"):
        RedisState(url)
