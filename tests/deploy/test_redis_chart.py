"""The chart's Redis: an external one (its URL, password and CA from Secrets) or the release's
own, run from an ACL file in a generated Secret (user pdserve, the password only as its SHA-256),
with every Redis client given the password by secretKeyRef; the rendered container run by the
real redis-server admits only the chart's credentials."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess

import kubernetes_validate
import pytest

from tests.deploy.test_helm import DRIVERS, container, find, manifests, one


def test_external_redis_url_comes_from_its_secret():
    """An external Redis is reached through the URL in the named Secret (which may carry its
    credentials); no Redis, no Redis Secret, no credentials of the chart's."""
    objects = manifests({"redis": {"enabled": False, "external": {"existingSecret": "redis-conn", "key": "url"}}})
    for name in DRIVERS:
        env = {e["name"]: e for e in container(one(objects, "Deployment", name))["env"]}
        assert env["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-conn", "key": "url"}
        assert not {"PDSERVE_REDIS_USERNAME", "PDSERVE_REDIS_PASSWORD", "PDSERVE_REDIS_CA_FILE"} & set(env), name
    assert not find(objects, "Deployment", "pdserve-redis") and not find(objects, "Secret", "pdserve-redis-auth")


EXTERNAL_WITH_AUTH = {"redis": {"enabled": False, "external": {
    "existingSecret": "redis-conn", "auth": {"existingSecret": "redis-pw", "key": "pw", "username": "llm"},
    "tls": {"caSecret": "redis-ca", "caKey": "ca.pem"}}}}


def test_external_redis_password_user_and_ca():
    """An external Redis' password comes from its Secret, the user as a value, and its TLS CA
    from a Secret mounted where PDSERVE_REDIS_CA_FILE points, in the controller and every gateway."""
    objects = manifests(EXTERNAL_WITH_AUTH)
    for name in DRIVERS:
        deployment = one(objects, "Deployment", name)
        driver = container(deployment)
        env = {e["name"]: e for e in driver["env"]}
        assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-pw", "key": "pw"}
        assert env["PDSERVE_REDIS_USERNAME"]["value"] == "llm"
        mount = next(m for m in driver["volumeMounts"] if m["name"] == "redis-ca")
        assert env["PDSERVE_REDIS_CA_FILE"]["value"] == f"{mount['mountPath']}/ca.pem" and mount["readOnly"]
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-ca")
        assert volume["secret"] == {"secretName": "redis-ca", "items": [{"key": "ca.pem", "path": "ca.pem"}]}
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


# -- the release's Redis: an ACL user with a password from a Secret ---------------------------------


def _secret_data(objects: list[dict], name: str) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in one(objects, "Secret", name)["data"].items()}


def test_release_redis_requires_the_acl_user(rendered):
    """The release's Redis loads the ACL file from its Secret (mounted read-only, only that key)
    and no longer turns protected mode off; its readiness probe logs in as the ACL user, with
    the password from the same Secret, and fails on an error reply (-e)."""
    _, objects = rendered
    deployment = one(objects, "Deployment", "pdserve-redis")
    redis = container(deployment)
    assert redis["command"] == ["redis-server", "--aclfile", "/etc/redis/users.acl", "--save", "", "--appendonly", "no"]
    assert "--protected-mode" not in redis["command"] and not redis.get("args")
    mount = next(m for m in redis["volumeMounts"] if m["name"] == "acl")
    assert mount == {"name": "acl", "mountPath": "/etc/redis", "readOnly": True}
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "acl")
    assert volume["secret"] == {"secretName": "pdserve-redis-auth", "defaultMode": 0o440,
                                "items": [{"key": "users.acl", "path": "users.acl"}]}
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "-e", "--user", "pdserve", "ping"]
    assert redis["env"] == [{"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": "pdserve-redis-auth",
                                                                                      "key": "password"}}}]


def test_redis_secret_holds_the_password_and_only_its_hash(rendered):
    """The generated Secret holds a 48-character random password and the ACL file Redis loads:
    `default` off, user pdserve with the SHA-256 of that very password (the plaintext is in no
    Redis config), every command but @dangerous."""
    _, objects = rendered
    data = _secret_data(objects, "pdserve-redis-auth")
    password = data["password"]
    assert len(password) == 48 and password.isalnum()
    assert data["users.acl"] == (f"user default off\nuser pdserve on #{hashlib.sha256(password.encode()).hexdigest()} "
                                 "~* &* +@all -@dangerous +acl|log\n")
    assert password not in data["users.acl"]
    assert _secret_data(manifests(), "pdserve-redis-auth")["password"] != password  # random per render, not fixed


def test_every_redis_client_gets_the_password(rendered):
    """Every container given a Redis URL (the controller and the gateways, no other) also gets
    the ACL user and the password from the Redis Secret; no password is a literal env value."""
    _, objects = rendered
    clients = set()
    for deployment in find(objects, "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert not any("PASSWORD" in k or k == "REDISCLI_AUTH" for k, e in env.items() if "value" in e), c["name"]
            if "PDSERVE_REDIS_URL" in env:
                clients.add(deployment["metadata"]["name"])
                assert env["PDSERVE_REDIS_USERNAME"]["value"] == "pdserve"
                assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-redis-auth",
                                                                                       "key": "password"}
    assert clients == set(DRIVERS)


def test_existing_redis_secret_is_used_not_generated():
    """With redis.auth.existingSecret no Redis Secret is rendered, and the Redis pod (ACL file,
    probe) and its clients all read the named one."""
    objects = manifests({"redis": {"auth": {"existingSecret": "my-redis"}}})
    assert [s["metadata"]["name"] for s in find(objects, "Secret")] == ["pdserve-ray-auth"]
    deployment = one(objects, "Deployment", "pdserve-redis")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "acl")
    assert volume["secret"]["secretName"] == "my-redis"
    assert container(deployment)["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "my-redis"
    for name in DRIVERS:
        env = {e["name"]: e for e in container(one(objects, "Deployment", name))["env"]}
        assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "password"}


def test_release_redis_admits_only_the_chart_password(tmp_path, monkeypatch):
    """The rendered Redis container, run by the real redis-server with the Secret's ACL file:
    the controller's and gateways' credentials (as the chart sets them) run the cluster state;
    the readiness probe passes with the Secret's password and fails without it or with another;
    no password, a wrong one, or the default user is refused; @dangerous commands are refused."""
    import redis as redis_py

    from cluster.redis_client import RedisAuthError
    from cluster.redis_state import RedisState
    from tests.cluster.test_redis_auth import ENV, exercise_state, start_redis_server
    from tests.conftest import stop_server
    objects = manifests()
    data = _secret_data(objects, "pdserve-redis-auth")
    server = container(one(objects, "Deployment", "pdserve-redis"))
    (tmp_path / "users.acl").write_text(data["users.acl"])
    argv = [a.replace("/etc/redis", str(tmp_path)) for a in server["command"]]
    assert argv[0] == "redis-server"
    proc, port = start_redis_server(tmp_path, *argv[1:])
    try:
        url = f"redis://127.0.0.1:{port}/0"
        for name in ENV:
            monkeypatch.delenv(name, raising=False)
        gateway = {e["name"]: e for e in container(one(objects, "Deployment", "pdserve-gateway"))["env"]}
        monkeypatch.setenv("PDSERVE_REDIS_USERNAME", gateway["PDSERVE_REDIS_USERNAME"]["value"])
        monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", data[gateway["PDSERVE_REDIS_PASSWORD"]["valueFrom"]
                                                          ["secretKeyRef"]["key"]])
        state = RedisState(url, namespace="chart")
        try:
            exercise_state(state)
            with pytest.raises(redis_py.exceptions.NoPermissionError):
                state._redis.config_set("dir", "/tmp")
        finally:
            state.close()
        probe = server["readinessProbe"]["exec"]["command"]
        probe = [*probe[:-1], "-p", str(port), probe[-1]]
        for password, passes in ((data["password"], True), ("not-it", False), (None, False)):
            env = {"PATH": os.environ["PATH"], **({"REDISCLI_AUTH": password} if password else {})}
            assert (subprocess.run(probe, env=env, capture_output=True, timeout=10).returncode == 0) == passes
        for user, password in ((None, None), ("pdserve", "not-it"), (None, data["password"])):
            monkeypatch.delenv("PDSERVE_REDIS_USERNAME", raising=False)
            monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
            if user:
                monkeypatch.setenv("PDSERVE_REDIS_USERNAME", user)
            if password:
                monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", password)
            with pytest.raises(RedisAuthError):
                RedisState(url)
    finally:
        stop_server(proc)
