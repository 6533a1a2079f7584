"""The chart's named API keys for the gateways (`gateway.apiKeys`): listed in the values (hashes
and limits only) they become a Secret holding the keys file that gateway/api_keys.py reads, or a
Secret of the user's is used as it is; either way the gateways (not the controller) mount it and
start with --api-keys-file."""
from __future__ import annotations

import helm_python as helm
import pytest

from gateway.api_keys import hash_api_key, load_api_keys
from tests.deploy.test_helm import container, find, manifests, one, render

KEYS = [{"name": "team-a", "sha256": hash_api_key("key-a"), "requests_per_second": 2.5, "burst": 5},
        {"name": "team-b", "sha256": hash_api_key("key-b"), "max_concurrent": 4}]
FLAG = "--api-keys-file /etc/pdserve-api-keys/keys.json"


def _shell(objects: list[dict], component: str) -> str:
    return container(one(objects, "Deployment", f"pdserve-{component}"))["command"][2]


def _keys_volume(objects: list[dict]) -> tuple[dict, dict]:
    gateway = one(objects, "Deployment", "pdserve-gateway")
    (mount,) = [m for m in container(gateway)["volumeMounts"] if m["name"] == "api-keys"]
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
    return mount, volume


def test_listed_keys_become_the_keys_file_the_gateways_read(tmp_path):
    objects = manifests({"gateway": {"apiKeys": {"keys": KEYS}}})
    secret = one(objects, "Secret", "pdserve-api-keys")
    (path := tmp_path / "keys.json").write_text(secret["stringData"]["keys.json"])
    loaded = {k.name: k for k in load_api_keys(path)}
    assert set(loaded) == {"team-a", "team-b"} and loaded["team-b"].max_concurrent == 4
    assert (loaded["team-a"].sha256, loaded["team-a"].requests_per_second, loaded["team-a"].burst) == \
        (hash_api_key("key-a"), 2.5, 5)
    assert "key-a" not in str(objects) and "key-b" not in str(objects)  # hashes only
    assert _shell(objects, "gateway").endswith(" " + FLAG) and FLAG not in _shell(objects, "controller")
    mount, volume = _keys_volume(objects)
    assert mount == {"name": "api-keys", "mountPath": "/etc/pdserve-api-keys", "readOnly": True}
    assert volume["secret"] == {"secretName": "pdserve-api-keys", "items": [{"key": "keys.json", "path": "keys.json"}]}


def test_an_existing_secret_is_mounted_as_it_is():
    objects = manifests({"gateway": {"apiKeys": {"existingSecret": "my-keys", "key": "api-keys.json"}}})
    assert not find(objects, "Secret", "pdserve-api-keys")
    assert _keys_volume(objects)[1]["secret"] == {"secretName": "my-keys",
                                                  "items": [{"key": "api-keys.json", "path": "keys.json"}]}
    assert _shell(objects, "gateway").endswith(" " + FLAG)


def test_without_keys_nothing_is_mounted_or_passed():
    objects = manifests()
    assert FLAG not in _shell(objects, "gateway") and not find(objects, "Secret", "pdserve-api-keys")
    mounts = container(one(objects, "Deployment", "pdserve-gateway"))["volumeMounts"]
    assert "api-keys" not in {m["name"] for m in mounts}


@pytest.mark.parametrize("bad", [{"keys": KEYS, "existingSecret": "my-keys"},
                                 {"keys": [{"name": "a", "sha256": "not-hex"}]},
                                 {"keys": [{"name": "a", "sha256": hash_api_key("k"), "max_concurrent": 0}]},
                                 {"keys": [{"name": "a", "sha256": hash_api_key("k"), "rate": 1}]}])
def test_keys_that_cannot_work_are_refused_at_render(bad):
    with pytest.raises(helm.HelmError, match="apiKeys"):
        render({"gateway": {"apiKeys": bad}})
