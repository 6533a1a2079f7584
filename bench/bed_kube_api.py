"""A Kubernetes API server for the chart's pods on the bed (bench/chart_pods.py): the calls pdserve's
autoscaler makes, answered from the bed's pods and acted on them, so the controller pod runs its
Kubernetes actuator as in a cluster.

    api = BedKubeAPI(pods).start()       # before pods.up(): ChartPods mounts its service account
    ...                                  # the controller pod scales and annotates through it
    api.scale_patches, api.pods_deleted, api.deleted_annotations, api.annotations(name); api.stop()

What it serves, over HTTPS (a self-signed certificate for the bridge address, made with openssl), to a
bearer token, and only what the rendered Role allows that token (else 403, as RBAC would):
- GET / PATCH  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale: `spec.replicas` and the pod
  selector; a patch up starts pods (ChartPods.start_pod), a patch down deletes pods as a ReplicaSet
  does: not running first, then the lowest `controller.kubernetes.io/pod-deletion-cost`, then the newest
  (at once, with no grace period: whatever still ran there is cut, which a test would see).
- GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...: the pods with their address and annotations.
- PATCH  /api/v1/namespaces/{ns}/pods/{name}: a JSON merge patch of `metadata.annotations`.
What a pod gets (kubelet's service-account mount): /var/run/secrets/kubernetes.io/serviceaccount/{token,
ca.crt,namespace} and KUBERNETES_SERVICE_HOST/PORT, the in-cluster config of the `kubernetes` client.
"""
from __future__ import annotations

import json
import logging
import secrets
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
COST = "controller.kubernetes.io/pod-deletion-cost"


class BedKubeAPI:
    def __init__(self, pods, address: str | None = None):
        self.pods = pods  # a ChartPods
        self.address = address or pods.bed.switch.host_ip(1)  # the bridge: every pod reaches it
        self.token = secrets.token_hex(16)
        self.dir = pods.bed.dir / "kube-api"
        self.lock = threading.RLock()
        self.replicas = {d["metadata"]["name"]: d["spec"].get("replicas", 1) for d in self._deployments()}
        self.meta: dict[str, dict] = {}  # pod name -> {"annotations": {...}, "created": n}
        self.scale_patches: list[tuple[str, int]] = []
        self.pods_deleted: list[str] = []
        self.deleted_annotations: dict[str, dict[str, str]] = {}  # what each deleted pod carried then
        self.forbidden: list[str] = []
        self._server = self._thread = None
        pods.kube_api = self

    # -- the server -------------------------------------------------------------------------------
    def start(self) -> BedKubeAPI:
        self.dir.mkdir(parents=True, exist_ok=True)
        key, cert = self.dir / "tls.key", self.dir / "ca.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=kubernetes", "-addext", f"subjectAltName=IP:{self.address}", "-keyout", str(key),
                        "-out", str(cert)], check=True, capture_output=True)
        self._server = ThreadingHTTPServer((self.address, 0), _handler(self))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="bed-kube-api")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def service_account(self, pod_name: str) -> tuple[Path, dict[str, str]]:
        """(the directory to mount at SERVICE_ACCOUNT_DIR, the env) of a pod that mounts its token."""
        path = self.dir / "serviceaccount"
        path.mkdir(parents=True, exist_ok=True)
        (path / "token").write_text(self.token)
        (path / "namespace").write_text(self.pods.namespace)
        (path / "ca.crt").write_bytes((self.dir / "ca.crt").read_bytes())
        port = self._server.server_address[1]
        return path, {"KUBERNETES_SERVICE_HOST": self.address, "KUBERNETES_SERVICE_PORT": str(port)}

    def annotations(self, pod_name: str) -> dict[str, str]:
        with self.lock:
            return dict(self.meta.get(pod_name, {}).get("annotations", {}))

    # -- requests ---------------------------------------------------------------------------------
    def handle(self, method: str, path: str, token: str, body: dict | None) -> tuple[int, dict]:
        url = urlsplit(path)
        parts = url.path.strip("/").split("/")
        if token != self.token:
            return 401, status(401, "Unauthorized", "bad bearer token")
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4:5] == ["pods"]:
            group, resource, ns, name = "", "pods", parts[3], (parts[5] if len(parts) > 5 else None)
            verb = "list" if method == "GET" else "patch"
        elif parts[:4] == ["apis", "apps", "v1", "namespaces"] and parts[5:6] == ["deployments"] \
                and parts[7:] == ["scale"]:
            group, resource, ns, name = "apps", "deployments/scale", parts[4], parts[6]
            verb = "get" if method == "GET" else "patch"
        else:
            return 404, status(404, "NotFound", f"not served here: {url.path}")
        if ns != self.pods.namespace or not self._allowed(group, resource, verb, name):
            self.forbidden.append(f"{verb} {resource} {name}")
            return 403, status(403, "Forbidden", f"the Role does not allow {verb} on {resource} {name}")
        with self.lock:
            if resource == "pods":
                if name is None:
                    return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                                 "items": self._pod_list(parse_qs(url.query).get("labelSelector", [""])[0])}
                return self._annotate(name, body)
            if name not in self.replicas:
                return 404, status(404, "NotFound", f'deployments.apps "{name}" not found')
            if method == "PATCH":
                self._scale(name, int(body["spec"]["replicas"]))
            return 200, self._scale_object(name)

    def _allowed(self, group: str, resource: str, verb: str, name: str | None) -> bool:
        """Whether a rule of the rendered Role allows it (resourceNames bind named requests only)."""
        for role in (o for o in self.pods.objects if o["kind"] == "Role"):
            for rule in role.get("rules", []):
                if group in rule.get("apiGroups", []) and resource in rule.get("resources", []) \
                        and verb in rule.get("verbs", []) \
                        and (not rule.get("resourceNames") or name in rule["resourceNames"]):
                    return True
        return False

    def _deployments(self) -> list[dict]:
        return [o for o in self.pods.objects if o["kind"] == "Deployment"]

    def _deployment(self, name: str) -> dict:
        (found,) = [d for d in self._deployments() if d["metadata"]["name"] == name]
        return found

    def _pods_of(self, deployment: dict) -> list[str]:
        labels = deployment["spec"]["selector"]["matchLabels"]
        return [n for n, p in self.pods._pods.items() if labels.items() <= p.template["metadata"]["labels"].items()]

    def _scale_object(self, name: str) -> dict:
        labels = self._deployment(name)["spec"]["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        n = self.replicas[name]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": {"name": name,
                "namespace": self.pods.namespace}, "spec": {"replicas": n} if n else {},
                "status": {"replicas": len(self._pods_of(self._deployment(name))), "selector": selector}}

    def _scale(self, name: str, n: int) -> None:
        """Pods started or deleted to `n`, as the Deployment's ReplicaSet would."""
        self.scale_patches.append((name, n))
        have = self._pods_of(self._deployment(name))
        self.replicas[name] = n
        component = self.pods._component(self._deployment(name)["spec"]["template"])
        for _ in range(n - len(have)):
            started = self.pods.start_pod(component)
            logger.info("bed kube API: %s scaled up: pod %s", name, started)
        order = sorted(have, key=lambda p: (self.pods.running(p), int(self.annotations(p).get(COST, "0")),
                                            -self._created(p)))
        for pod in order[:max(0, len(have) - n)]:
            logger.info("bed kube API: %s scaled down: pod %s (%s)", name, pod, self.annotations(pod))
            self.deleted_annotations[pod] = self.annotations(pod)
            self.pods.delete_pod(pod)
            self.pods_deleted.append(pod)

    def _created(self, pod: str) -> int:
        return list(self.pods.pods).index(pod)  # ChartPods keeps start order

    def _pod_list(self, selector: str) -> list[dict]:
        want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        return [self._pod_object(name) for name, pod in self.pods._pods.items()
                if want.items() <= pod.template["metadata"]["labels"].items()]

    def _pod_object(self, name: str) -> dict:
        """The pod as the API shows it: name, labels, annotations, address and phase."""
        return {"metadata": {"name": name, "namespace": self.pods.namespace,
                             "labels": self.pods._pods[name].template["metadata"]["labels"],
                             "annotations": self.annotations(name) or None},
                "status": {"podIP": self.pods.address(name),
                           "phase": "Running" if self.pods.running(name) else "Failed"}}

    def _annotate(self, name: str, body: dict | None) -> tuple[int, dict]:
        if name not in self.pods.pods:
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        if not body or body.keys() != {"metadata"} or body["metadata"].keys() != {"annotations"}:
            return 422, status(422, "Invalid", "this API takes annotation merge patches only")
        meta = self.meta.setdefault(name, {"annotations": {}})
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                meta["annotations"].pop(key, None)
            else:
                meta["annotations"][key] = str(value)
        return 200, self._pod_object(name)


def status(code: int, reason: str, message: str) -> dict:
    """A Kubernetes Status object: the body of every error the API server answers."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def json_handler(handle):
    """A BaseHTTPRequestHandler class that answers GET and PATCH with `handle(method, path, headers, raw body)`
    -> (HTTP code, JSON object); an exception in it is a 500 with a Status, not a hung client."""
    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                code, obj = handle(self.command, self.path, self.headers, raw)
            except Exception as exc:
                logger.exception("kube API: %s %s", self.command, self.path)
                code, obj = 500, status(500, "InternalError", repr(exc))
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve

        def log_message(self, *args):
            pass

    return Handler


def _handler(api: BedKubeAPI):
    def handle(method: str, path: str, headers, raw: bytes) -> tuple[int, dict]:
        scheme, _, token = (headers.get("Authorization") or "").partition(" ")
        token = token if scheme.lower() == "bearer" else ""  # (the client writes "bearer")
        return api.handle(method, path, token, json.loads(raw) if raw else None)
    return json_handler(handle)
