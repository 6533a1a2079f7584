"""KubernetesActuator: sizes the prefill and decode pools through the `scale` subresource of two
worker Deployments.

    current()  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale  -> spec.replicas
    apply(t)   PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale  {"spec": {"replicas": n}}
               (pools that grow first, then pools that shrink, each after drain(role, n_remove))

Why the scale subresource and not the Deployment itself: least privilege. The autoscaler's Role only
needs `get` and `patch` on `apps` `deployments/scale`; it cannot change images, env or commands, and
a patch of `/scale` touches nothing but the replica count (it is also what `kubectl scale` and the
HorizontalPodAutoscaler use).

Kubernetes picks which pods to delete on a scale-down, so the instances must be idle by then:
`drain(role, n_remove)` (when given) asks the in-cluster Ray side to drain that many instances of
the pool (no new requests, running ones finish) before the patch. Growing pools are patched first,
so capacity never dips below the smaller of the old and new sizes.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from cluster.autoscale.actuators import Actuator, ActuatorError, PoolSizes

logger = logging.getLogger(__name__)

# The namespace of the pod we run in, mounted by Kubernetes with the service-account token.
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# NOTE: the API server accepts a JSON merge patch (RFC 7386) on every resource, /scale included; we
# set it explicitly instead of relying on the client's default for PATCH bodies.
PATCH_CONTENT_TYPE = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 10.0  # per API call, so a hung API server cannot stall the autoscaler loop

_HINTS = {
    401: "the credentials were rejected (expired token or wrong kubeconfig user)",
    403: "the Role bound to this service account must allow get and patch on apps deployments/scale",
    404: "no such Deployment in this namespace (check the name and the namespace)",
}


class KubernetesActuator(Actuator):
    """Scales the prefill and decode worker Deployments.

    Args:
        prefill_deployment / decode_deployment: names of the worker Deployments.
        namespace: their namespace; None = the pod's own namespace, else "default".
        api_client: a `kubernetes.client.ApiClient`; None = in-cluster config, else kubeconfig.
        drain: `drain(role, n_remove)`, called before a pool shrinks by `n_remove` replicas
            (role is "prefill" or "decode"); its exceptions propagate and nothing is patched.
        dry_run: log each decision and patch nothing.
    """

    def __init__(self, prefill_deployment: str, decode_deployment: str, namespace: str | None = None,
                 api_client: client.ApiClient | None = None,
                 drain: Callable[[str, int], None] | None = None, dry_run: bool = False):
        self.deployments = {"prefill": prefill_deployment, "decode": decode_deployment}
        self.namespace = namespace if namespace is not None else _own_namespace()
        self.apps = client.AppsV1Api(api_client if api_client is not None else _load_api_client())
        self.drain = drain
        self.dry_run = dry_run

    def current(self) -> PoolSizes:
        """Returns:
            PoolSizes of the two Deployments' desired replicas (`spec.replicas` of their scale).
        """
        return PoolSizes(prefill=self._read_replicas("prefill"), decode=self._read_replicas("decode"))

    def apply(self, target: PoolSizes) -> None:
        """Patches the replicas of each pool whose size differs from `target`; draining first
        on a scale-down. Raises ActuatorError on any API or connection error."""
        if target.prefill < 0 or target.decode < 0:
            raise ValueError(f"pool sizes must be >= 0, got {target}")
        now, want = self.current(), {"prefill": target.prefill, "decode": target.decode}
        changes = [(role, getattr(now, role), n) for role, n in want.items() if getattr(now, role) != n]
        changes.sort(key=lambda change: change[2] < change[1])  # grow before shrinking
        for role, old, new in changes:
            where = f"deployments/{self.deployments[role]}/scale in namespace {self.namespace}"
            if self.dry_run:
                logger.info("kubernetes (dry run): %s %s: %d -> %d replicas", role, where, old, new)
                continue
            if new < old and self.drain is not None:
                self.drain(role, old - new)
            self._patch_replicas(role, new)
            logger.info("kubernetes: scaled %s %s: %d -> %d replicas", role, where, old, new)

    def _read_replicas(self, role: str) -> int:
        name = self.deployments[role]
        try:
            scale = self.apps.read_namespaced_deployment_scale(
                name, self.namespace, _request_timeout=REQUEST_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise self._error("get", name, e) from e
        # NOTE: the API omits `replicas` when it is 0 (omitempty), so None means a pool of zero.
        return (scale.spec.replicas if scale.spec is not None else None) or 0

    def _patch_replicas(self, role: str, replicas: int) -> None:
        name = self.deployments[role]
        try:
            self.apps.patch_namespaced_deployment_scale(
                name, self.namespace, {"spec": {"replicas": replicas}},
                _content_type=PATCH_CONTENT_TYPE, _request_timeout=REQUEST_TIMEOUT_S)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise self._error("patch", name, e) from e

    def _error(self, verb: str, name: str, e: Exception) -> ActuatorError:
        what = f"cannot {verb} deployments/{name}/scale in namespace {self.namespace!r}"
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
