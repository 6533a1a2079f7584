"""Actuators: what turns an autoscaling decision (pool sizes) into instances.

    Actuator.current() -> PoolSizes      what runs now
    Actuator.apply(PoolSizes)            make it so (scale-down drains first)

`RayActuator` adds and removes instances of the running cluster; `KubernetesActuator`
(cluster/autoscale/kubernetes_actuator.py) patches the scale of the worker Deployments; `DryRunActuator`
only logs. The policies that decide live in cluster/autoscale/autoscaler.py.
"""
from __future__ import annotations

import logging
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger(__name__)
MAX_PARALLEL_ADDS = 64  # instances a RayActuator starts at once


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


class ActuatorError(RuntimeError):
    """An actuator could not read or change the pool sizes (the reason is in the message)."""


class Actuator(ABC):
    @abstractmethod
    def current(self) -> PoolSizes:
        """The pool sizes now (instances, or desired replicas of the worker Deployments)."""

    @abstractmethod
    def apply(self, target: PoolSizes) -> None:
        """Move to `target`. Raises ActuatorError when that cannot be done."""

    def measured(self) -> dict[str, float]:
        """What this actuator's moves took, for the planner: `startup_s` (an added instance, from the
        ask to serving) and `flip_s` (a drained instance's rebuild), the median of the last few;
        a key only once measured."""
        return {}


class DryRunActuator(Actuator):
    """Logs each decision and pretends it happened (so the planner sees its own decisions)."""

    def __init__(self, start: PoolSizes):
        self.sizes = start

    def current(self) -> PoolSizes:
        return self.sizes

    def apply(self, target: PoolSizes) -> None:
        if target != self.sizes:
            logger.info("autoscaler (dry run): %s -> %s", self.sizes, target)
        self.sizes = target


class RayActuator(Actuator):
    """Adds and removes instances of a running `Cluster`. A pool shrinks by draining its least
    loaded instance (no new requests; it leaves once its requests have finished). With `flips`, a
    decision that grows one pool and shrinks the other flips the shrinking pool's least loaded
    instances to the growing role first (cluster/control/flip.py: a drain and a rebuild of its
    worker, no model load), then adds or removes what is left; a flip the cluster refuses (TP sizes
    that differ, speculative decoding) falls back to adding and removing, said in the log."""

    def __init__(self, cluster, drain_timeout_s: float = 120.0, flips: bool = True):
        self.cluster, self.drain_timeout_s, self.flips = cluster, drain_timeout_s, flips
        self.times: dict[str, deque[float]] = {"startup_s": deque(maxlen=8), "flip_s": deque(maxlen=8)}

    def measured(self) -> dict[str, float]:
        return {key: statistics.median(times) for key, times in self.times.items() if times}

    def _serving(self, role: str) -> list:
        """The InstanceInfos of `role` that take requests (healthy, not draining)."""
        return [i for i in self.cluster.instance_infos() if i.role == role and i.healthy and not i.draining]

    def _ids(self, role: str) -> list[str]:
        return [i.instance_id for i in self._serving(role)]

    def current(self) -> PoolSizes:
        return PoolSizes(len(self._ids("prefill")), len(self._ids("decode")))

    def apply(self, target: PoolSizes) -> None:
        if self.flips:
            self._flip_toward(target)
        for role in ("prefill", "decode"):
            ids, want = self._ids(role), getattr(target, role)
            self._add(role, want - len(ids))
            if want < len(ids):
                self.drain(role, len(ids) - want)

    def _add(self, role: str, count: int) -> None:
        """`count` instances of `role`, started at once (up to MAX_PARALLEL_ADDS): a step of load needs
        them all, and one after the other a step of n would take n cold starts (instances that share
        a GPU still start one at a time: the controller's lock)."""
        if count <= 0:
            return
        with ThreadPoolExecutor(max_workers=min(count, MAX_PARALLEL_ADDS), thread_name_prefix="autoscaler-add") as pool:
            futures = [pool.submit(self._add_one, role) for _ in range(count)]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:  # no room in Ray, model load failed: say so, keep serving
            raise ActuatorError(f"cannot add {len(failed)} of {count} {role} instances: {failed[0]}") from failed[0]

    def _add_one(self, role: str) -> None:
        start = time.monotonic()
        iid = self.cluster.add_instance(role)
        self.times["startup_s"].append(time.monotonic() - start)
        logger.info("autoscaler: added a %s instance %s in %.1f s", role, iid, self.times["startup_s"][-1])

    def _flip_toward(self, target: PoolSizes) -> None:
        """Flips instances from the pool over its target to the pool under it, least loaded first."""
        now = self.current()
        for src, dst in (("prefill", "decode"), ("decode", "prefill")):
            count = min(getattr(now, src) - getattr(target, src), getattr(target, dst) - getattr(now, dst))
            for iid in self._least_loaded(src)[:max(0, count)]:
                try:
                    took = self.cluster.flip_instance(iid, dst, self.drain_timeout_s)
                except ValueError as exc:  # the cluster cannot flip (its spec): add and remove instead
                    logger.info("autoscaler: no flip (%s); adding and removing instead", exc)
                    return
                self.times["flip_s"].append(took["rebuild_s"])  # (the planner models the drain itself)
                logger.info("autoscaler: flipped %s from %s to %s in %.2f s (drain %.2f s)", iid, src, dst,
                            took["total_s"], took["drain_s"])

    def _least_loaded(self, role: str) -> list[str]:
        key = "queued_prefill_tokens" if role == "prefill" else "running"
        return [i.instance_id for i in sorted(self._serving(role), key=lambda i: getattr(i.load, key))]

    def drain(self, role: str, count: int) -> None:
        """Drains and removes `count` instances of `role`, least loaded first, one at a time."""
        for iid in self._least_loaded(role)[:count]:
            drained = self.cluster.drain_instance(iid, self.drain_timeout_s)
            logger.info("autoscaler: removed %s (%s)", iid, "drained" if drained else "drain timed out")


class PodsThenInstances(Actuator):
    """Kubernetes: `pods` (a KubernetesActuator) sizes the worker Deployments, `instances` (a RayActuator)
    moves the instances on their pods: the Deployments that grow first (the new instances' placement
    groups wait for the new pods' Ray resources), then the instances (flips where the pods are shared,
    adds, drains), then the Deployments that shrink, by the pods left with no instance."""

    def __init__(self, pods, instances: RayActuator):
        self.pods, self.instances = pods, instances

    def current(self) -> PoolSizes:
        return self.instances.current()

    def apply(self, target: PoolSizes) -> None:
        self.pods.grow(target)
        self.instances.apply(target)
        self.pods.shrink(target)

    def measured(self) -> dict[str, float]:
        """(An instance's start only: a pod's own start is not yet measured here.)"""
        return self.instances.measured()
