"""KubernetesActuator: sizes the worker Deployments through their `scale` subresource, and marks their pods.

    current()  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale  -> spec.replicas
    grow(t)    PATCH .../deployments/{name}/scale  {"spec": {"replicas": n}}   the Deployments that grow
    shrink(t)  PATCH /api/v1/namespaces/{ns}/pods/{pod}  (role and deletion-cost annotations), then
               PATCH .../deployments/{name}/scale down, by at most the pods that host no instance
    apply(t)   grow, drain(role, n_remove) where given, shrink

Two layouts (spec worker_pods, the chart's `workerPods`): `per_role`, a prefill and a decode Deployment
whose pods carry their role's Ray resource; `shared`, one worker Deployment whose pods serve either
role, so instances flip in place (cluster/control/flip.py) and the Deployment follows the two pools'
sum. Either way each pod carries the role it serves as the `pdserve.io/role` annotation
(cluster/autoscale/kubernetes_pods.py), and the pods with no instance the lowest deletion cost, so a
scale-down takes those and never a pod that serves.

Why the scale subresource and not the Deployment itself: least privilege. The autoscaler's Role needs
`get` and `patch` on `apps` `deployments/scale` (it cannot change images, env or commands; a patch of
`/scale` touches nothing but the replica count, as `kubectl scale` and the HorizontalPodAutoscaler do),
and `list` and `patch` on pods for the annotations.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from collections.abc import Callable, Mapping

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from cluster.autoscale.actuators import Actuator, ActuatorError, PoolSizes
from cluster.autoscale.kubernetes_pods import PodMarks

logger = logging.getLogger(__name__)

# The namespace of the pod we run in, mounted by Kubernetes with the service-account token.
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# NOTE: the API server accepts a JSON merge patch (RFC 7386) on every resource, /scale included; we
# set it explicitly instead of relying on the client's default for PATCH bodies.
PATCH_CONTENT_TYPE = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 10.0  # per API call, so a hung API server cannot stall the autoscaler loop

_HINTS = {
    401: "the credentials were rejected (expired token or wrong kubeconfig user)",
    403: "the Role bound to this service account must allow get and patch on apps deployments/scale, "
         "list and patch on pods",
    404: "no such Deployment in this namespace (check the name and the namespace)",
}
SHARED = "worker"  # the one Deployment's key with spec worker_pods shared


class KubernetesActuator(Actuator):
    """Scales the worker Deployments and marks their pods.

    Args:
        deployments: {"prefill": name, "decode": name} (per-role pods) or {"worker": name} (shared pods).
        namespace: their namespace; None = the pod's own, else "default".
        api_client: a `kubernetes.client.ApiClient`; None = in-cluster config, else kubeconfig.
        placed: `placed()` -> {node address: role or "draining"} of the instances now
            (kubernetes_pods.placed_roles); None: pods are not marked, and a shrink is not bounded by them.
        drain: `drain(role, n_remove)`, called by apply() before a pool shrinks (its exceptions propagate
            and nothing is patched).
        dry_run: log each decision and patch nothing.
    """

    def __init__(self, deployments: Mapping[str, str], namespace: str | None = None,
                 api_client: client.ApiClient | None = None, placed: Callable[[], Mapping[str, str]] | None = None,
                 drain: Callable[[str, int], None] | None = None, dry_run: bool = False):
        if set(deployments) not in ({"prefill", "decode"}, {SHARED}):
            raise ValueError(f"deployments: prefill and decode, or worker; got {sorted(deployments)}")
        self.deployments = dict(deployments)
        self.namespace = namespace if namespace is not None else _own_namespace()
        api_client = api_client if api_client is not None else _load_api_client()
        self.apps = client.AppsV1Api(api_client)
        self.pod_marks = PodMarks(client.CoreV1Api(api_client), self.namespace, REQUEST_TIMEOUT_S)
        self.placed, self.drain, self.dry_run = placed, drain, dry_run

    @property
    def shared(self) -> bool:
        return SHARED in self.deployments

    def current(self) -> PoolSizes:
        """Per-role: the two Deployments' desired replicas. Shared: the worker pods marked with each role."""
        if self.shared:
            roles = self._call("list pods of", SHARED, lambda: self.pod_marks.roles(self._selector(SHARED)))
            return PoolSizes(prefill=roles.get("prefill", 0), decode=roles.get("decode", 0))
        return PoolSizes(prefill=self._replicas("prefill"), decode=self._replicas("decode"))

    def apply(self, target: PoolSizes) -> None:
        """Grows what grows, drains what shrinks (`drain`), then shrinks. Raises ActuatorError on any
        API or connection error."""
        now = self.current()
        self.grow(target)
        for role in ("prefill", "decode"):
            if getattr(target, role) < getattr(now, role) and self.drain is not None and not self.dry_run:
                self.drain(role, getattr(now, role) - getattr(target, role))
        self.shrink(target)

    def grow(self, target: PoolSizes) -> None:
        """Patches up each Deployment that `target` needs bigger (the pods new instances land on)."""
        for key, old, new in self._changes(target):
            if new > old:
                self._resize(key, old, new)

    def shrink(self, target: PoolSizes) -> None:
        """Marks every pod with what it serves now (with `placed`), then patches down each Deployment
        `target` needs smaller, by at most its pods that host no instance."""
        for key, old, new in self._changes(target):
            if self.placed is not None and not self.dry_run:
                selector = self._selector(key)
                idle = self._call("mark pods of", key, lambda: self.pod_marks.mark(selector, self.placed()))
                if new < old - idle:
                    logger.warning("kubernetes: %s should shrink %d -> %d, but only %d of its pods host no instance: "
                                   "down to %d", self.deployments[key], old, new, idle, old - idle)
                    new = old - idle
            if new < old:
                self._resize(key, old, new)

    def _changes(self, target: PoolSizes) -> list[tuple[str, int, int]]:
        """(deployment key, replicas now, replicas `target` needs) for each Deployment."""
        if target.prefill < 0 or target.decode < 0:
            raise ValueError(f"pool sizes must be >= 0, got {target}")
        if self.shared:
            return [(SHARED, self._replicas(SHARED), target.prefill + target.decode)]
        return [(role, self._replicas(role), getattr(target, role)) for role in ("prefill", "decode")]

    def _resize(self, key: str, old: int, new: int) -> None:
        name = self.deployments[key]
        where = f"deployments/{name}/scale in namespace {self.namespace}"
        if self.dry_run:
            logger.info("kubernetes (dry run): %s %s: %d -> %d replicas", key, where, old, new)
            return
        self._call("patch", key, lambda: self.apps.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": new}}, _content_type=PATCH_CONTENT_TYPE,
            _request_timeout=REQUEST_TIMEOUT_S))
        logger.info("kubernetes: scaled %s %s: %d -> %d replicas", key, where, old, new)

    def _scale(self, key: str):
        return self._call("get", key, lambda: self.apps.read_namespaced_deployment_scale(
            self.deployments[key], self.namespace, _request_timeout=REQUEST_TIMEOUT_S))

    def _replicas(self, key: str) -> int:
        # NOTE: the API omits `replicas` when it is 0 (omitempty), so None means a pool of zero.
        scale = self._scale(key)
        return (scale.spec.replicas if scale.spec is not None else None) or 0

    def _selector(self, key: str) -> str:
        """The label selector of the Deployment's pods, as its scale reports it."""
        selector = self._scale(key).status.selector
        if not selector:
            raise ActuatorError(f"deployments/{self.deployments[key]}/scale reports no pod selector")
        return selector

    def _call(self, verb: str, key: str, call):
        try:
            return call()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise self._error(verb, self.deployments[key], e) from e

    def _error(self, verb: str, name: str, e: Exception) -> ActuatorError:
        subject = f"deployments/{name}" if verb.endswith(" of") else f"deployments/{name}/scale"
        what = f"cannot {verb} {subject} in namespace {self.namespace!r}"
        if not isinstance(e, ApiException):
            host = self.apps.api_client.configuration.host
            return ActuatorError(f"{what}: Kubernetes API at {host} unreachable ({e})")
        message = f"{what}: HTTP {e.status} {e.reason}"
        try:
            message += f": {json.loads(e.body)['message']}"  # the API server's Status object
        except (TypeError, ValueError, KeyError):
            pass
        hint = _HINTS.get(e.status)
        return ActuatorError(f"{message} ({hint})" if hint else message)


def _load_api_client() -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig; into a private Configuration
    so the client library's global default is left alone."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except ConfigException as e:
        in_cluster_error = e
    try:
        config.load_kube_config(client_configuration=configuration)
    except (ConfigException, OSError) as e:
        raise ActuatorError(
            "no Kubernetes config: not running in a pod with a service account "
            f"({in_cluster_error}) and no usable kubeconfig ({e})") from e
    return client.ApiClient(configuration)


def _own_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
    except OSError:
        logger.info("kubernetes: %s not found (not in a pod); using namespace 'default'",
                    SERVICE_ACCOUNT_NAMESPACE_FILE)
        return "default"
