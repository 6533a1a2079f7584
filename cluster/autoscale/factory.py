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
    `autoscale_forecast` names; flips where the actuator can flip (not Kubernetes: cluster/autoscale/actuators.py)."""
    return SLOPlanner(profile, limits, spec.ttft_slo_s, spec.tbt_slo_s, rate_window_s=3 * spec.autoscale_interval_s,
                      forecaster=create_forecaster(spec.autoscale_forecast, spec.autoscale_interval_s),
                      flips=spec.autoscale_actuator != "kubernetes")


def _queue(spec: ClusterSpec, profile: Profile | None, limits: ScalingLimits) -> Policy:
    return QueueThreshold(limits)


def _ray(cluster, spec: ClusterSpec) -> Actuator:
    return RayActuator(cluster)


def _kubernetes(cluster, spec: ClusterSpec) -> Actuator:
    """Worker Deployments sized first, instances placed on their pods (PodsThenInstances)."""
    from cluster.autoscale.kubernetes_actuator import KubernetesActuator  # the kubernetes client only when asked
    ray_side = RayActuator(cluster, flips=False)  # (a pod carries its role's Ray resources: no flips)
    pods = KubernetesActuator(spec.k8s_prefill_deployment, spec.k8s_decode_deployment, spec.k8s_namespace,
                              drain=ray_side.drain)
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
