"""Only the cluster's own processes get in (docs/security.md), on the Helm chart's pods: a foreign
process on a host of its own, in the pods' network but holding none of the chart's Secrets,
speaks the KV protocol to the decode instance and commands to Redis, and is refused and counted;
the decode instance's cache stays empty and the cluster serves on. And the gateways' API keys:
a key over its rate is refused while another is served; a body too big never reaches the router."""
from __future__ import annotations

import base64
import json
import sys

import httpx
import pytest

from bench.chart_pods import BED_AUTH, BED_MAX_REQUEST_BYTES, BED_TIGHT_KEY
from bench.multihost import HostSpec
from tests.multihost.conftest import PROMPTS
from tests.multihost.test_gateways import checked, instances, pods_of, wait_until
from tests.multihost.streams import Stream

pytestmark = pytest.mark.timeout(600)

# A process with a secret of its own: the protocol's client (handshake refused), then a raw
# socket sending a well-formed hello with no handshake at all (closed unanswered).
ROGUE_KV = """import json, socket, sys, msgpack
from kvtransfer import wire
from kvtransfer.control import ControlClient, ControlError
address = (sys.argv[1], int(sys.argv[2]))
hello = {"kind": "hello", "sender_id": "rogue", "compat": {}, "device_key": ""}
out = {}
try:
    ControlClient(address, wire.SCHEMA).call(hello, timeout_s=20)
    out["client"] = "answered"
except ControlError as exc:
    out["client"] = type(exc).__name__ + ": " + str(exc)
with socket.create_connection(address, timeout=20) as sock:
    sock.sendall(msgpack.packb(hello))
    data, sock_closed = b"", False
    while not sock_closed:
        chunk = sock.recv(65536)
        data, sock_closed = data + chunk, not chunk
    out["raw_reply_bytes"] = len(data)
print(json.dumps(out))
"""


def secret_value(chart, suffix: str, key: str) -> str:
    (secret,) = [o for o in chart.objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith(suffix)]
    data = secret.get("data") or {}
    return base64.b64decode(data[key]).decode() if key in data else secret["stringData"][key]


@pytest.fixture
def rogue(chart):
    """A host on the chart's network running nothing of the cluster's: no Ray token, no Redis password."""
    chart.bed.add_host(HostSpec("rogue", "pod"))
    yield "rogue"
    chart.bed.remove_host("rogue")


def decode_load(chart) -> tuple[str, dict]:
    (decode,) = [i for i in instances(chart.url(pods_of(chart, "controller")[0])).values() if i["role"] == "decode"]
    return decode["instance_id"], decode


def test_a_foreign_process_is_refused_by_the_kv_endpoint_and_by_redis(chart, rogue, reference):
    iid, decode = decode_load(chart)
    refused_before = decode["load"].get("kv_peers_refused", 0.0)
    (host, port), = decode["kv_endpoints"]
    env = {"PDSERVE_CLUSTER_SECRET": "not-the-cluster-secret", "RAY_AUTH_TOKEN": ""}
    out = chart.bed.run(rogue, [sys.executable, "-c", ROGUE_KV, host, str(port)], timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["client"].startswith("ControlAuthError") and result["raw_reply_bytes"] < 100, result
    wait_until(lambda: decode_load(chart)[1]["load"]["kv_peers_refused"] - refused_before >= 2, 60,
               "the decode instance to count both refused peers")
    load = decode_load(chart)[1]["load"]
    assert load["kv_usage"] == load["reserved"] == load["running"] == 0, load

    redis_host = chart.address(pods_of(chart, "redis")[0])
    password = secret_value(chart, "-redis-auth", "password")
    cli = ["redis-cli", "-h", redis_host, "-p", "6379", "-e"]
    denied_before = _refused_passwords(chart, password)
    for argv, refusal in [(["SET", "pdserve:rogue", "1"], "NOAUTH"),
                          (["--user", "pdserve", "--pass", "guess", "--no-auth-warning", "PING"], "WRONGPASS"),
                          (["--user", "default", "--pass", "guess", "--no-auth-warning", "PING"], "WRONGPASS")]:
        out = chart.bed.run(rogue, cli + argv, timeout=30)
        assert out.returncode != 0 and refusal in out.stdout + out.stderr, (argv, out.stdout, out.stderr)
    assert _refused_passwords(chart, password) - denied_before == 2  # the two guesses, counted
    assert _redis(chart, cli, password, "EXISTS", "pdserve:rogue") == "0"  # nothing written

    for s in [Stream(chart.url(pods_of(chart, "gateway")[0]), p) for p in PROMPTS[:2]]:
        checked(s, reference)


def _redis(chart, cli: list[str], password: str, *command: str) -> str:
    """A command as the cluster's user, from the controller's pod (the policy lets it in)."""
    ctl = pods_of(chart, "controller")[0]
    out = chart.bed.run(ctl, cli + ["--user", "pdserve", "--no-auth-warning", *command], timeout=30,
                        env={"REDISCLI_AUTH": password})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()



def _refused_passwords(chart, password: str) -> int:
    """Redis' own count of refused logins (ACL LOG, reason auth), asked as the cluster's user."""
    import redis
    client = redis.Redis(chart.address(pods_of(chart, "redis")[0]), 6379, username="pdserve", password=password)
    try:
        return sum(int(e["count"]) for e in client.acl_log() if e["reason"] == "auth")
    finally:
        client.close()


def _key_outcomes(url: str) -> dict[tuple[str, str], float]:
    """The gateway's pdserve_api_key_requests_total by (key name, outcome)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.labels["key"], s.labels["outcome"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pdserve_api_key_requests_total"}


def test_a_key_over_its_rate_gets_429_while_another_is_served_and_a_big_body_413(chart):
    """The chart's keys (bench/chart_pods.py BED_VALUES): "tight" allows one request per 20 s, so
    its second is answered 429 with Retry-After while "bed" is served; a body past the spec's
    max_request_bytes is answered 413 by the gateway's guard, before the body is parsed or
    routed; a key not in the file, 401."""
    url = chart.url(pods_of(chart, "gateway")[0])
    body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    tight = {"Authorization": f"Bearer {BED_TIGHT_KEY}"}
    before = _key_outcomes(url)
    answers = [httpx.post(url + "/v1/completions", json=body, headers=tight, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 429], answers[1].text
    assert answers[1].json()["error"]["code"] == "rate_limit_exceeded" and int(answers[1].headers["retry-after"]) >= 1
    assert httpx.post(url + "/v1/completions", json=body, headers=BED_AUTH, timeout=120).status_code == 200
    big = httpx.post(url + "/v1/completions", headers=BED_AUTH, timeout=60,
                     json={**body, "prompt": "x" * (BED_MAX_REQUEST_BYTES + 1)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large", big.text
    stranger = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer guess"}, timeout=60)
    assert stranger.status_code == 401
    after = _key_outcomes(url)
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grew == {("tight", "served"): 1, ("tight", "rate_limited"): 1, ("bed", "served"): 1,
                    ("bed", "too_large"): 1, ("_none", "unauthorized"): 1}, grew
