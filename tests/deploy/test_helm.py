"""The Helm chart (deploy/helm/pdserve), rendered offline by real Helm (helm-python-sdk, no
binary, no cluster) and checked three ways: against the Kubernetes API schemas
(kubernetes-validate, strict), against its own values.schema.json, and against the cluster spec
the controller and the gateways will load from it (`ClusterSpec.from_dict`)."""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from cluster import spec as cluster_spec
from cluster.spec import ClusterSpec
from engine.core.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES

pytestmark = pytest.mark.timeout(300)

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
GPU_VALUES = yaml.safe_load((CHART / "ci" / "gpu-values.yaml").read_text())
RELEASE, NAMESPACE = "pdserve", "serving"
RAY_PODS = ("pdserve-head", "pdserve-prefill", "pdserve-decode", "pdserve-controller", "pdserve-gateway")
DRIVERS = ("pdserve-controller", "pdserve-gateway")  # Ray drivers: `ray start` then `pdserve <command>`
# Cluster spec keys the chart sets itself (from the pod or from other values), so values.spec refuses them.
CHART_OWNED_SPEC_KEYS = {
    "host", "port", "ray_address", "redis_url", "api_key", "ray_resources", "autoscale", "autoscale_policy",
    "autoscale_actuator", "ttft_slo_s", "tbt_slo_s", "min_prefill", "max_prefill", "min_decode", "max_decode",
    "k8s_namespace", "k8s_prefill_deployment", "k8s_decode_deployment", "k8s_worker_deployment", "worker_pods",
    "api_keys_file",
}
AUTOSCALED = {"autoscaler": {"enabled": True, "policy": "queue", "ttftSloS": 1.5, "minDecode": 2, "maxDecode": 6},
              "decode": {"replicas": 2}}
VALUE_SETS = {
    "default": None,
    "gpu": GPU_VALUES,
    "everything-on": {**AUTOSCALED, "redis": {"enabled": True}, "imagePullSecrets": [{"name": "regcred"}],
                      "ingress": {"enabled": True, "className": "nginx", "tls": {"enabled": True, "secretName": "t"}},
                      "gateway": {"apiKey": {"existingSecret": "pdserve-api-key"}},
                      "ucx": {"tls": "rc,tcp", "netDevices": "mlx5_0:1", "ipcLock": True,
                              "rdmaResources": {"rdma/rdma_shared_device_a": 1}}},
}


def render(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def manifests(values: dict | None = None) -> list[dict]:
    """Every object the chart renders: multi-document templates split, NOTES.txt and empty documents skipped."""
    objects = []
    for path, text in render(values).items():
        if not path.endswith("NOTES.txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = find(objects, kind, name)
    return found


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def merged_values(values: dict | None) -> dict:
    """The chart's defaults with `values` over them: what the templates see."""
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def loaded_spec(objects: list[dict]) -> ClusterSpec:
    return ClusterSpec.from_dict(yaml.safe_load(one(objects, "ConfigMap", "pdserve-spec")["data"]["spec.yaml"]))


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_lint_has_no_errors(values):
    """`helm lint` (schema, templates, Chart.yaml) reports no error; warnings are printed, not fatal."""
    report = helm.lint(CHART, values, namespace=NAMESPACE, kube_version="v1.30.0")
    for message in report["messages"]:
        if message["severity"] == 2:
            print(f"helm lint warning: {message['path']}: {message['error']}")
    assert report["errors"] == [], report["errors"]


@pytest.mark.parametrize("kube_version", ["1.30.0", kubernetes_validate.latest_version()])
def test_manifests_validate_against_kubernetes(rendered, kube_version):
    """Every rendered object is valid for the oldest supported (1.30) and the newest Kubernetes
    the installed kubernetes-validate knows, in strict mode (unknown fields are errors)."""
    _, objects = rendered
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {kube_version}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_renders_every_component(rendered):
    """Head, both worker pools, the controller and the gateways always render; Redis unless an
    external one is named; Ingress and RBAC only when asked."""
    values, objects = rendered
    values = values or {}
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", f"pdserve-{c}") for c in ("head", "prefill", "decode", "controller", "gateway")} <= names
    assert {("Service", f"pdserve-{c}") for c in ("head", "controller", "gateway")} <= names
    assert ("ConfigMap", "pdserve-spec") in names
    assert (("Deployment", "pdserve-redis") in names) == values.get("redis", {}).get("enabled", True)
    assert bool(find(objects, "Ingress")) == values.get("ingress", {}).get("enabled", False)
    assert bool(find(objects, "Role")) == values.get("autoscaler", {}).get("enabled", False)
    assert {o["metadata"]["name"] for o in find(objects, "PodDisruptionBudget")} == {
        "pdserve-prefill", "pdserve-decode", "pdserve-gateway"}
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "pdserve-0.1.0" and "app.kubernetes.io/component" in labels


@pytest.mark.parametrize("bad, where", [
    ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    ({"replicaCount": 2}, "replicaCount"),
    ({"spec": {"num_prefil": 2}}, "num_prefil"),
    ({"spec": {"max_num_seqs": "many"}}, "/spec/max_num_seqs"),
    ({"spec": {"dtype": "fp8"}}, "/spec/dtype"),
    ({"spec": {"api_key": "sk-leaked-into-a-configmap"}}, "api_key"),
    ({"gateway": {"service": {"port": "8000"}}}, "/gateway/service/port"),
    ({"decode": {"resources": {"limit": {"cpu": 1}}}}, "limit"),
    ({"autoscaler": {"policy": "fast"}}, "/autoscaler/policy"),
    ({"redis": {"auth": {"password": "in-the-values"}}}, "password"),
    ({"networkPolicy": {"metricsFrom": [{"namespace": "monitoring"}]}}, "namespace"),
    ({"spec": {"otlp_traces_endpoint": "otel-collector:4318"}}, "/spec/otlp_traces_endpoint"),
], ids=["negative-replicas", "misspelled-top-level", "misspelled-spec-key", "wrong-type", "bad-enum",
        "chart-owned-spec-key", "port-as-string", "misspelled-nested", "unknown-policy", "plaintext-redis-password",
        "not-a-peer", "otlp-endpoint-not-a-url"])
def test_schema_rejects_bad_values(bad, where):
    """A typo or a wrong type fails the render and the lint, naming the offending key."""
    with pytest.raises(helm.HelmValuesError, match=where):
        render(bad)
    errors = helm.lint(CHART, bad)["errors"]
    assert errors and any(where in e for e in errors), errors


@pytest.mark.parametrize("bad, message", [
    ({"spec": {"num_decode": 3}}, "spec.num_decode=3 exceeds"),
    ({"autoscaler": {"enabled": True, "minPrefill": 3, "maxPrefill": 2}}, "minPrefill"),
    ({"autoscaler": {"enabled": True}, "decode": {"instancesPerPod": 2}}, "instancesPerPod to 1"),
    ({"redis": {"enabled": True, "external": {"existingSecret": "r"}}}, "not both"),
    ({"redis": {"external": {"existingSecret": "r"}}}, "not both"),
    ({"redis": {"enabled": False}}, "meet in Redis"),
    ({"redis": {"enabled": False, "external": {"existingSecret": "r", "auth": {"username": "u"}}}},
     "redis.external.auth.username needs its password"),
    ({"redis": {"external": {"auth": {"existingSecret": "p"}}}}, "apply to an external Redis"),
    ({"redis": {"external": {"tls": {"caSecret": "ca"}}}}, "apply to an external Redis"),
    ({"redis": {"enabled": False, "auth": {"existingSecret": "s"}, "external": {"existingSecret": "r"}}},
     "for an external Redis use redis.external.auth"),
    ({"ingress": {"enabled": True, "tls": {"enabled": True}}}, "ingress.tls.secretName"),
])
def test_templates_refuse_inconsistent_values(bad, message):
    """Combinations a schema cannot express fail the render with a message saying what to fix."""
    with pytest.raises(helm.HelmError, match=message):
        render(bad)


_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def _json_type(tp) -> set[str]:
    return {_JSON_NAMES[arg] for arg in (typing.get_args(tp) or (tp,))}


def test_schema_spec_keys_are_cluster_spec_fields():
    """values.spec accepts exactly the ClusterSpec fields the chart does not own, each with its
    Python type, and the same choices; so a new spec field without a schema entry fails here."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["spec"]["properties"]
    hints = typing.get_type_hints(ClusterSpec)
    assert set(schema) == {f.name for f in dataclasses.fields(ClusterSpec)} - CHART_OWNED_SPEC_KEYS
    for key, prop in schema.items():
        if "enum" in prop:
            assert {_JSON_NAMES[type(choice)] for choice in prop["enum"]} <= _json_type(hints[key]), key
        else:
            declared = {prop["type"]} if isinstance(prop["type"], str) else set(prop["type"])
            assert declared == _json_type(hints[key]), key
    assert tuple(schema["dtype"]["enum"]) == DTYPE_CHOICES
    assert tuple(schema["kv_cache_dtype"]["enum"]) == KV_CACHE_DTYPE_CHOICES
    assert tuple(schema["quantization"]["enum"]) == QUANTIZATION_CHOICES
    assert tuple(schema["router_policy"]["enum"]) == cluster_spec.ROUTER_POLICIES
    assert tuple(schema["attention_backend"]["enum"]) == cluster_spec.ATTENTION_BACKENDS
    assert set(schema["mode"]["enum"]) <= set(cluster_spec.MODES)
    assert tuple(schema["tool_call_parser"]["enum"]) == (*cluster_spec.TOOL_CALL_PARSERS, None)
    assert tuple(schema["reasoning_parser"]["enum"]) == (*cluster_spec.REASONING_PARSERS, None)
    root = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert tuple(root["autoscaler"]["properties"]["policy"]["enum"]) == cluster_spec.AUTOSCALE_POLICIES


def test_spec_configmap_loads_as_cluster_spec(rendered):
    """The spec.yaml of the controller and the gateways is a valid ClusterSpec that names the rendered worker
    Deployments, the release namespace, and pools no larger than the worker pods can hold."""
    values, objects = rendered
    spec = loaded_spec(objects)
    deployments = {d["metadata"]["name"]: d for d in find(objects, "Deployment")}
    assert spec.k8s_prefill_deployment == "pdserve-prefill" and spec.k8s_prefill_deployment in deployments
    assert spec.k8s_decode_deployment == "pdserve-decode" and spec.k8s_decode_deployment in deployments
    assert spec.k8s_namespace == NAMESPACE and spec.ray_resources is True
    for role, count in spec.instance_counts.items():
        pool = deployments[f"pdserve-{role}"]
        resources = next(a for a in container(pool)["command"] if a.startswith("--resources="))
        units_per_pod = json.loads(resources.removeprefix("--resources="))[role]  # one per rank
        assert count * spec.tp_size(role) <= pool["spec"]["replicas"] * units_per_pod, role
    user_spec = (values or {}).get("spec", {})
    assert all(getattr(spec, key) == value for key, value in user_spec.items())


def test_cluster_name_is_the_release_unless_set():
    """The instances' Ray namespace and Redis key prefix (`cluster_name`) is the release's full
    name, so releases sharing an external Redis do not mix; a value in spec wins."""
    assert loaded_spec(manifests()).cluster_name == "pdserve"
    objects = manifests({"fullnameOverride": "llm-a"})
    spec = ClusterSpec.from_dict(yaml.safe_load(one(objects, "ConfigMap", "llm-a-spec")["data"]["spec.yaml"]))
    assert spec.cluster_name == "llm-a"
    assert loaded_spec(manifests({"spec": {"cluster_name": "shared.1"}})).cluster_name == "shared.1"


def test_autoscaler_keys_reach_the_spec():
    """With the autoscaler on, the spec turns autoscaling on with the Kubernetes actuator and the
    chart's SLOs and bounds; with it off, the spec keeps autoscaling off."""
    spec = loaded_spec(manifests(AUTOSCALED))
    assert spec.autoscale and spec.autoscale_actuator == "kubernetes" and spec.autoscale_policy == "queue"
    assert (spec.ttft_slo_s, spec.tbt_slo_s) == (1.5, 0.1)
    assert (spec.min_prefill, spec.max_prefill, spec.min_decode, spec.max_decode) == (1, 4, 2, 6)
    assert not loaded_spec(manifests()).autoscale


def test_autoscaler_rbac_is_least_privilege():
    """The autoscaler may only get and patch the scale of the two worker Deployments and list and
    annotate pods, in its own namespace, and the controller pod (where it runs) uses that
    ServiceAccount; without it, no RBAC and no token. The gateways never mount a token."""
    objects = manifests(AUTOSCALED)
    (role,) = find(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["pdserve-prefill", "pdserve-decode"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
    (binding,) = find(objects, "RoleBinding")
    (account,) = find(objects, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    pod = one(objects, "Deployment", "pdserve-controller")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    default_objects = manifests()
    for name, objs in (("pdserve-controller", default_objects), ("pdserve-gateway", default_objects),
                       ("pdserve-gateway", objects)):
        pod = one(objs, "Deployment", name)["spec"]["template"]["spec"]
        assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False, name


def _driver_shell(deployment: dict) -> str:
    (shell, flag, script) = container(deployment)["command"]
    assert (shell, flag) == ("sh", "-c")
    return script


@pytest.mark.parametrize("name, command", [("pdserve-controller", "controller"), ("pdserve-gateway", "gateway")])
def test_driver_probes_and_command(rendered, name, command):
    """The controller and the gateways are probed on /health (liveness, startup) and /ready
    (readiness) on their http port, join Ray as a node without CPUs at their own address, then
    exec `pdserve controller|gateway` on the mounted spec with the release's Redis."""
    values, objects = rendered
    deployment = one(objects, "Deployment", name)
    driver = container(deployment)
    assert driver["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert driver["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert driver["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert {"name": "http", "containerPort": 8000} in driver["ports"]
    assert _driver_shell(deployment) == (
        "ray start --address=pdserve-head:6379 --num-cpus=0 --node-ip-address=$(PDSERVE_NODE_IP) && "
        f"exec pdserve {command} --config /etc/pdserve/spec.yaml --host 0.0.0.0 --port 8000 "
        "--ray-address auto")
    mounts = {m["name"]: m["mountPath"] for m in driver["volumeMounts"]}
    assert mounts["spec"] == "/etc/pdserve"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["spec"]["configMap"]["name"] == "pdserve-spec"
    env = {e["name"]: e for e in driver["env"]}
    assert env["PDSERVE_REDIS_URL"]["value"] == "redis://pdserve-redis:6379/0"
    api_key = (values or {}).get("gateway", {}).get("apiKey", {}).get("existingSecret")
    assert ("PDSERVE_API_KEY" in env) == bool(api_key and command == "gateway")
    if "PDSERVE_API_KEY" in env:
        assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": api_key, "key": "api-key"}


def test_one_controller_never_two(rendered):
    """The controller owns the instances: one replica, and Recreate, so the old one is gone
    before a new one starts (two would both start and replace instances)."""
    _, objects = rendered
    spec = one(objects, "Deployment", "pdserve-controller")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}


def test_gateways_are_many_and_roll_without_a_gap():
    """Two gateways by default (`gateway.replicas`), replaced one at a time with the new one ready
    first (maxUnavailable 0), behind one Service, each with a disruption budget."""
    for replicas, values in ((2, None), (5, {"gateway": {"replicas": 5}})):
        objects = manifests(values)
        spec = one(objects, "Deployment", "pdserve-gateway")["spec"]
        assert spec["replicas"] == replicas
        assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        assert one(objects, "PodDisruptionBudget", "pdserve-gateway")["spec"]["selector"] == spec["selector"]
    with pytest.raises(helm.HelmValuesError, match="/gateway/replicas"):
        render({"gateway": {"replicas": 0}})


def test_every_ray_node_advertises_its_pod_address(rendered):
    """Every pod that joins Ray (head, workers, controller, gateways) gets PDSERVE_NODE_IP from its
    own pod IP (the downward API) and passes it to every `ray start` as --node-ip-address, which
    kubelet expands; so Ray nodes and ranks advertise the address other pods reach them at."""
    _, objects = rendered
    for name in RAY_PODS:
        deployment = one(objects, "Deployment", name)
        env = {e["name"]: e for e in container(deployment)["env"]}
        assert env["PDSERVE_NODE_IP"] == {"name": "PDSERVE_NODE_IP",
                                          "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, name
        command = container(deployment)["command"]
        words = _driver_shell(deployment).split() if name in DRIVERS else command
        starts = [i for i, w in enumerate(words) if w == "ray" and words[i + 1] == "start"]
        assert len(starts) == 1, name
        assert "--node-ip-address=$(PDSERVE_NODE_IP)" in words[starts[0]:], name


def test_ray_pods_use_token_auth(rendered):
    """Head, workers, controller and gateways all run Ray with token auth, reading the token from one Secret the
    release renders, and get a memory-backed /dev/shm for Ray's object store."""
    _, objects = rendered
    secret = one(objects, "Secret", "pdserve-ray-auth")
    assert len(secret["data"]["token"]) > 48  # base64 of 48 random characters
    for name in RAY_PODS:
        pod = one(objects, "Deployment", name)["spec"]["template"]["spec"]
        env = {e["name"]: e for e in container(one(objects, "Deployment", name))["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        token = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": secret["metadata"]["name"], "key": "token"}, name
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory", name
        kv = env["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert kv == {"name": secret["metadata"]["name"], "key": "cluster-secret", "optional": True}, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name


def test_the_kv_cluster_secret_is_generated_apart_from_the_ray_token(rendered):
    """The generated Secret holds a KV cluster secret of its own (64 characters, not Ray's token),
    so a leaked Ray token does not open the KV channel and the other way round."""
    import base64
    _, objects = rendered
    data = one(objects, "Secret", "pdserve-ray-auth")["data"]
    token, kv = (base64.b64decode(data[k]).decode() for k in ("token", "cluster-secret"))
    assert len(kv) == 64 and kv.isalnum() and kv != token


@pytest.mark.parametrize("niceness,want", [(None, "0"), (5, "5"), (-5, "0")])
def test_ray_pods_start_workers_at_the_rank_niceness(niceness, want):
    """Every Ray pod's raylet starts workers at the spec's rank_niceness (at least 0), not Ray's 15:
    the pods run as non-root, so a rank could not lower its own priority."""
    objects = manifests(None if niceness is None else {"spec": {"rank_niceness": niceness}})
    for name in RAY_PODS:
        env = {e["name"]: e for e in container(one(objects, "Deployment", name))["env"]}
        assert env["RAY_worker_niceness"]["value"] == want, name


def test_existing_ray_secret_is_used_not_generated():
    """With ray.auth.existingSecret the chart renders no token Secret and points every Ray pod at the given one."""
    objects = manifests({"ray": {"auth": {"existingSecret": "ray-token", "existingSecretKey": "t"}}})
    assert [s["metadata"]["name"] for s in find(objects, "Secret")] == ["pdserve-redis-auth"]
    for name in RAY_PODS:
        env = {e["name"]: e for e in container(one(objects, "Deployment", name))["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ray-token", "key": "t"}


def test_ray_head_command_and_ports(rendered):
    """The head schedules no work (num-cpus 0) and publishes only the GCS: not the Ray client
    (10001) nor the dashboard (8265), which nothing uses and which stays on the pod's localhost."""
    _, objects = rendered
    head = container(one(objects, "Deployment", "pdserve-head"))
    assert head["command"] == ["ray", "start", "--head", "--port=6379", "--num-cpus=0",
                               "--node-ip-address=$(PDSERVE_NODE_IP)", "--block"]
    ports = {p["name"]: p["port"] for p in one(objects, "Service", "pdserve-head")["spec"]["ports"]}
    assert ports == {"gcs": 6379}
    assert [p["containerPort"] for p in head["ports"]] == [6379]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_pods_carry_role_resource_and_gpus(rendered, role):
    """A worker pod joins the head as a Ray node with the pool's CPUs, GPUs and one unit of its role
    resource per rank it hosts (instancesPerPod x TP, as cluster/control/cluster.py asks one per rank); its
    `nvidia.com/gpu` limit equals the GPUs it advertises to Ray, and its grace period outlasts the
    preStop drain."""
    values, objects = rendered
    pool = merged_values(values)[role]
    ranks = pool["instancesPerPod"] * loaded_spec(objects).tp_size(role)
    deployment = one(objects, "Deployment", f"pdserve-{role}")
    worker = container(deployment)
    command = worker["command"]
    assert command[:3] == ["ray", "start", "--address=pdserve-head:6379"] and command[-1] == "--block"
    assert "--node-ip-address=$(PDSERVE_NODE_IP)" in command
    assert f"--num-cpus={pool['cpus']}" in command and f"--num-gpus={pool['gpu']}" in command
    assert f'--resources={{"{role}":{ranks}}}' in command
    limits = worker["resources"]["limits"]
    assert limits.get("nvidia.com/gpu", 0) == pool["gpu"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod.get("nodeSelector", {}) == pool["nodeSelector"] and pod.get("tolerations", []) == pool["tolerations"]
    assert worker["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pool["drainSeconds"])]
    assert pod["terminationGracePeriodSeconds"] > pool["drainSeconds"]


def test_gpu_values_request_gpus():
    """The GPU variant puts an `nvidia.com/gpu` limit on every worker pod, and none on the others."""
    for deployment in find(manifests(GPU_VALUES), "Deployment"):
        limits = container(deployment).get("resources", {}).get("limits", {})
        is_worker = deployment["metadata"]["name"] in ("pdserve-prefill", "pdserve-decode")
        assert (limits.get("nvidia.com/gpu", 0) >= 1) == is_worker, deployment["metadata"]["name"]


def test_gpu_values_pass_the_model_fit_check():
    """The GPU variant's spec, as the pods load it, is one `pdserve serve` would start: its TP sizes
    split the model (cluster/control/model_fit.py, the check that refused TP 2 for SmolLM2's 9 heads)."""
    from cluster.control import model_fit
    model_fit.check(loaded_spec(manifests(GPU_VALUES)))
    with pytest.raises(ValueError, match="--prefill-tp 2 cannot run"):
        model_fit.check(loaded_spec(manifests({**GPU_VALUES, "spec": {**GPU_VALUES["spec"], "prefill_tp": 2}})))


def test_gpu_values_give_each_tp_group_one_pod():
    """In the GPU variant a pod holds the GPUs of all the instances it hosts (instancesPerPod x TP),
    so no tensor-parallel group is split across pods."""
    spec = loaded_spec(manifests(GPU_VALUES))
    assert spec.device == "cuda" and spec.dtype == "bfloat16" and spec.prefill_tp > 1
    for role in ("prefill", "decode"):
        pool = GPU_VALUES[role]
        assert pool["gpu"] == pool["instancesPerPod"] * spec.tp_size(role), role
        assert pool["cpus"] >= pool["gpu"], role


def test_the_kv_disk_tier_is_a_worker_volume_the_spec_points_at():
    """spec.kv_disk_tier_gib > 0 mounts kvDiskTier's volume on every worker pod and sets the spec's
    kv_disk_tier_dir to its mount; without it, no such volume; a volume source with a name is refused."""
    pvc = {"persistentVolumeClaim": {"claimName": "kv"}}
    objects = manifests({"spec": {"kv_host_tier_gib": 2, "kv_disk_tier_gib": 50}, "kvDiskTier": {"volume": pvc}})
    spec = loaded_spec(objects)
    assert spec.kv_disk_tier_gib == 50 and spec.kv_disk_tier_dir == "/var/cache/pdserve/kv"
    for role in ("prefill", "decode"):
        pod = one(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
        assert {"name": "kv-disk-tier", **pvc} in pod["volumes"]
        assert {"name": "kv-disk-tier", "mountPath": "/var/cache/pdserve/kv"} in container({"spec": {"template": {
            "spec": pod}}})["volumeMounts"]
    default = one(manifests({"spec": {"kv_host_tier_gib": 2, "kv_disk_tier_gib": 50}}), "Deployment", "pdserve-decode")
    assert {"name": "kv-disk-tier", "emptyDir": {}} in default["spec"]["template"]["spec"]["volumes"]
    plain = manifests()
    assert loaded_spec(plain).kv_disk_tier_dir is None
    assert not any(v["name"] == "kv-disk-tier" for d in find(plain, "Deployment")
                   for v in d["spec"]["template"]["spec"].get("volumes", []))
    with pytest.raises(Exception, match="kvDiskTier"):
        render({"kvDiskTier": {"volume": {"name": "x", "emptyDir": {}}}})


def test_ucx_values_reach_every_worker_and_nothing_else():
    """kv_transport nixl with ucx values: every worker container gets UCX_TLS and UCX_NET_DEVICES, the
    IPC_LOCK capability (all others still dropped) and the RDMA device in its limits; the default
    values give none of them, and no other pod gets any."""
    ucx = {"tls": "tcp", "netDevices": "eth0", "ipcLock": True, "rdmaResources": {"rdma/hca": 2}}
    objects = manifests({"spec": {"kv_transport": "nixl"}, "ucx": ucx})
    assert loaded_spec(objects).kv_transport == "nixl"
    for role in ("prefill", "decode"):
        c = container(one(objects, "Deployment", f"pdserve-{role}"))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "eth0", role
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, role
        assert c["resources"]["limits"]["rdma/hca"] == 2, role
    for d in find(objects, "Deployment"):
        if d["metadata"]["name"] not in ("pdserve-prefill", "pdserve-decode"):
            assert "IPC_LOCK" not in str(d) and "UCX_" not in str(d), d["metadata"]["name"]
    for role in ("prefill", "decode"):
        c = container(one(manifests(), "Deployment", f"pdserve-{role}"))
        assert "UCX_" not in str(c["env"]) and "add" not in c["securityContext"]["capabilities"]
    with pytest.raises(Exception, match="ucx"):
        render({"ucx": {**ucx, "tls": "tcp; rm -rf /"}})
