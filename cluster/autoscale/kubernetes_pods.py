"""What the Kubernetes actuator writes on worker pods: the role each serves, and which one a scale-down takes.

    marks(pod, placed)     {"pdserve.io/role": "prefill"|"decode"|"draining"|"idle",
                            "controller.kubernetes.io/pod-deletion-cost": "0"|"-50"|"-100"}
    PodMarks(core, ns)     .mark(selector, placed) patches the pods whose marks differ; returns the idle ones

A Deployment that shrinks deletes the pods of lowest `controller.kubernetes.io/pod-deletion-cost` first
(after the ones not yet ready), so the pods hosting no instance go, never one that serves: the Ray side
drains instances first, the marks then name the empty pods, then the replicas drop by at most as many.
A pod is matched to its instances by address: its `status.podIP` is its Ray node's address (the chart's
`ray start --node-ip-address=$(PDSERVE_NODE_IP)`), which every rank reports (Controller.instance_status).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

ROLE_ANNOTATION = "pdserve.io/role"
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
IDLE, DRAINING = "idle", "draining"
DELETION_COST = {IDLE: -100, DRAINING: -50}  # any serving role: 0 (a pod with no mark: 0 too)
PATCH_CONTENT_TYPE = "application/merge-patch+json"


def placed_roles(instance_status: list[dict]) -> dict[str, str]:
    """{node address: the role of the instance there, or "draining"} from Controller.instance_status()
    rows (every rank's node address; an instance's ranks share one node)."""
    placed = {}
    for row in instance_status:
        for rank in row.get("ranks", ()):
            placed[rank["node_ip"]] = DRAINING if row.get("draining") else row["role"]
    return placed


def marks(pod, placed: Mapping[str, str]) -> dict[str, str]:
    """The annotations `pod` (a V1Pod) should carry, given `placed` (placed_roles)."""
    role = placed.get(pod.status.pod_ip or "", IDLE) if pod.status is not None else IDLE
    return {ROLE_ANNOTATION: role, DELETION_COST_ANNOTATION: str(DELETION_COST.get(role, 0))}


class PodMarks:
    """Reads and patches the worker pods of one Deployment (by its scale's label selector)."""

    def __init__(self, core, namespace: str, timeout_s: float):
        self.core, self.namespace, self.timeout_s = core, namespace, timeout_s

    def pods(self, selector: str) -> list:
        """The live pods `selector` matches (those being deleted left out)."""
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector,
                                             _request_timeout=self.timeout_s).items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def roles(self, selector: str) -> dict[str, int]:
        """How many of the pods carry each role mark (unmarked pods count as idle)."""
        counts: dict[str, int] = {}
        for pod in self.pods(selector):
            role = (pod.metadata.annotations or {}).get(ROLE_ANNOTATION, IDLE)
            counts[role] = counts.get(role, 0) + 1
        return counts

    def mark(self, selector: str, placed: Mapping[str, str]) -> int:
        """Patches each pod whose marks differ from what `placed` says; returns how many pods host no
        instance (idle: a scale-down may take that many without touching one that serves)."""
        idle = 0
        for pod in self.pods(selector):
            want = marks(pod, placed)
            idle += want[ROLE_ANNOTATION] == IDLE
            have = pod.metadata.annotations or {}
            if all(have.get(key) == value for key, value in want.items()):
                continue
            self.core.patch_namespaced_pod(pod.metadata.name, self.namespace, {"metadata": {"annotations": want}},
                                           _content_type=PATCH_CONTENT_TYPE, _request_timeout=self.timeout_s)
            logger.info("kubernetes: pod %s is %s (deletion cost %s)", pod.metadata.name, want[ROLE_ANNOTATION],
                        want[DELETION_COST_ANNOTATION])
        return idle
