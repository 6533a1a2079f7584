"""The autoscaler's two registries: the policy and the actuator a spec names (`autoscale_policy`,
`autoscale_actuator`). Their names are the spec's choices, checked at import (cluster/spec.py
`spec_registry`); each entry builds its object from the spec."""
from __future__ import annotations

from cluster.autoscale.actuators import Actuator, DryRunActuator, PodsThenInstances, RayActuator
from cluster.autoscale.autoscaler import Policy, Profile, QueueThreshold, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import create_forecaster
from cluster.spec import ClusterSpec, spec_registry


def _slo(spec: ClusterSpec, profile: Profile | None, limits: ScalingLimits) -> Policy:
    """TTFT/TBT targets from a profile (None: measured online until there is one), the load forecast
    `autoscale_forecast` names; flips where instances can flip (not on per-role worker pods)."""
    return SLOPlanner(profile, limits, spec.ttft_slo_s, spec.tbt_slo_s, rate_window_s=3 * spec.autoscale_interval_s,
                      forecaster=create_forecaster(spec.autoscale_forecast, spec.autoscale_interval_s),
                      flips=_can_flip(spec))


def _can_flip(spec: ClusterSpec) -> bool:
    """Whether an instance may change role where it runs: not when its worker pod carries one role's
    Ray resource (cluster/control/flip.py refuses those)."""
    return not spec.ray_resources or spec.worker_pods == "shared"


def _queue(spec: ClusterSpec, profile: Profile | None, limits: ScalingLimits) -> Policy:
    return QueueThreshold(limits)


def _ray(cluster, spec: ClusterSpec) -> Actuator:
    return RayActuator(cluster)


def _kubernetes(cluster, spec: ClusterSpec) -> Actuator:
    """Worker Deployments sized around the instances' own moves (PodsThenInstances): the two per-role
    Deployments, or with worker_pods shared the one whose pods serve either role (and flips)."""
    from cluster.autoscale.kubernetes_actuator import KubernetesActuator  # the kubernetes client only when asked
    from cluster.autoscale.kubernetes_pods import placed_roles
    ray_side = RayActuator(cluster, flips=_can_flip(spec))
    if spec.worker_pods == "shared":
        deployments = {"worker": spec.k8s_worker_deployment}
    else:
        deployments = {"prefill": spec.k8s_prefill_deployment, "decode": spec.k8s_decode_deployment}
    pods = KubernetesActuator(deployments, spec.k8s_namespace, placed=lambda: placed_roles(cluster.instance_status()))
    return PodsThenInstances(pods, ray_side)


def _dry_run(cluster, spec: ClusterSpec) -> Actuator:
    return DryRunActuator(RayActuator(cluster).current())


POLICIES = spec_registry("autoscale_policy", {"slo": _slo, "queue": _queue})
ACTUATORS = spec_registry("autoscale_actuator", {"ray": _ray, "kubernetes": _kubernetes, "dry_run": _dry_run})


def create_policy(spec: ClusterSpec, profile: Profile | None, limits: ScalingLimits) -> Policy:
    """The policy `spec.autoscale_policy` names (the spec has checked the name)."""
    return POLICIES[spec.autoscale_policy](spec, profile, limits)


def create_actuator(cluster, spec: ClusterSpec) -> Actuator:
    """The actuator `spec.autoscale_actuator` names, over `cluster` (a Cluster or a Controller)."""
    return ACTUATORS[spec.autoscale_actuator](cluster, spec)
