"""A fake Kubernetes API on loopback for the KubernetesActuator's tests: apps/v1 deployments/scale (GET,
PATCH) with each Deployment's pod selector, and core/v1 pods (list by label selector, PATCH of
annotations). A scale-down deletes pods as a ReplicaSet does: the lowest
`controller.kubernetes.io/pod-deletion-cost` first, then the newest."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from bench.bed_kube_api import json_handler, status

NS = "pd"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
MERGE_PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass
class RecordedRequest:
    method: str
    path: str
    content_type: str | None
    body: dict | None


@dataclass
class FakePod:
    name: str
    deployment: str
    ip: str | None
    created: int  # a ReplicaSet deletes the newest first, cost being equal
    annotations: dict = field(default_factory=dict)

    def as_json(self, ns: str) -> dict:
        return {"metadata": {"name": self.name, "namespace": ns, "annotations": dict(self.annotations) or None,
                             "labels": {"component": self.deployment},
                             "creationTimestamp": f"2026-01-01T00:{self.created // 60:02d}:{self.created % 60:02d}Z"},
                "status": {"podIP": self.ip, "phase": "Running" if self.ip else "Pending"}}


class FakeKubeAPI:
    """Replicas per (namespace, name), with `pods` when `with_pods` (one per replica, addresses
    10.0.0.1, ...; a scale-up adds pods, a scale-down deletes as a ReplicaSet); every request recorded;
    `timeline` gets ("PATCH", name) per scale patch and ("ANNOTATE", pod) per pod patch."""

    def __init__(self, replicas: dict[tuple[str, str], int], forbidden_namespaces=(), with_pods: bool = False):
        self.replicas = dict(replicas)
        self.forbidden_namespaces = set(forbidden_namespaces)
        self.requests: list[RecordedRequest] = []
        self.timeline: list[tuple] = []
        self.resource_version = 1
        self.lock = threading.Lock()
        self.pods: dict[tuple[str, str], FakePod] = {}
        self.deleted: list[str] = []
        self._made = 0
        if with_pods:
            for (ns, name), n in self.replicas.items():
                self._add_pods(ns, name, n)

    def patches(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "PATCH" and r.path.endswith("/scale")]

    def pods_of(self, deployment: str, ns: str = NS) -> list[FakePod]:
        return [p for (pns, _), p in self.pods.items() if pns == ns and p.deployment == deployment]

    def handle(self, method: str, path: str, content_type: str | None, raw: bytes) -> tuple[int, dict]:
        body = json.loads(raw) if raw else None
        with self.lock:
            self.requests.append(RecordedRequest(method, path, content_type, body))
            url = urlsplit(path)
            parts = url.path.strip("/").split("/")
            if parts[:3] == ["api", "v1", "namespaces"] and parts[4:5] == ["pods"]:
                return self._pods(method, parts, parse_qs(url.query), content_type, body)
            # apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
            if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[5] != "deployments" \
                    or parts[7] != "scale":
                return 404, status(404, "NotFound", f"the server could not find the requested resource {path}")
            ns, name = parts[4], parts[6]
            if ns in self.forbidden_namespaces:
                verb = "get" if method == "GET" else "patch"
                return 403, status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                                   f'"system:serviceaccount:{ns}:autoscaler" cannot {verb} resource '
                                   f'"deployments/scale" in API group "apps" in the namespace "{ns}"')
            if (ns, name) not in self.replicas:
                return 404, status(404, "NotFound", f'deployments.apps "{name}" not found')
            if method == "PATCH":
                if content_type not in MERGE_PATCH_TYPES or not isinstance(body, dict):
                    return 415, status(415, "UnsupportedMediaType", f"unsupported patch {content_type}")
                self._resize(ns, name, body["spec"]["replicas"])
                self.resource_version += 1
                self.timeline.append(("PATCH", name))
            return 200, self.scale(ns, name)

    def scale(self, ns: str, name: str) -> dict:
        n = self.replicas[(ns, name)]
        return {
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": str(self.resource_version)},
            "spec": {"replicas": n} if n else {},  # like the real API: replicas is omitempty
            "status": {"replicas": n, "selector": f"component={name}"},
        }

    def _resize(self, ns: str, name: str, n: int) -> None:
        old = self.replicas[(ns, name)]
        self.replicas[(ns, name)] = n
        if not self.pods:
            return
        if n > old:
            self._add_pods(ns, name, n - old)
        ranked = sorted(self.pods_of(name, ns), key=lambda p: (int(p.annotations.get(COST, 0)), -p.created))
        for pod in ranked[:max(0, old - n)]:
            del self.pods[(ns, pod.name)]
            self.deleted.append(pod.name)

    def _add_pods(self, ns: str, name: str, n: int) -> None:
        for _ in range(n):
            self._made += 1
            pod = FakePod(f"{name}-{self._made}", name, f"10.0.0.{self._made}", self._made)
            self.pods[(ns, pod.name)] = pod

    def _pods(self, method, parts, query, content_type, body) -> tuple[int, dict]:
        ns = parts[3]
        if method == "GET" and parts[4:] == ["pods"]:
            key, _, value = query.get("labelSelector", [""])[0].partition("=")
            assert key == "component", query
            items = [p.as_json(ns) for p in self.pods_of(value, ns)]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if method == "PATCH" and len(parts) == 6 and (ns, parts[5]) in self.pods:
            if content_type not in MERGE_PATCH_TYPES or body.keys() != {"metadata"} \
                    or body["metadata"].keys() != {"annotations"}:
                return 422, status(422, "Invalid", "only annotation merge patches here")
            pod = self.pods[(ns, parts[5])]
            pod.annotations.update(body["metadata"]["annotations"])
            self.timeline.append(("ANNOTATE", pod.name))
            return 200, pod.as_json(ns)
        return 404, status(404, "NotFound", f"pods {parts[4:]} not found")


def serve(api: FakeKubeAPI, monkeypatch):
    """Serves `api` on loopback (no proxy): yields its URL, then stops it."""
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), json_handler(
        lambda method, path, headers, raw: api.handle(method, path, headers.get("Content-Type"), raw)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
