"""A role flip (issue 55 item 1): an instance becomes a prefill, decode or colocated instance in place,
keeping its processes, weights, compiled kernels and KV pool; only its worker, KV transport ends and
scheduler are rebuilt (cluster/ranks/rank.py RankHost.flip), in seconds where a new instance loads its
model for tens of them.

    flip_instance(controller, "prefill-1", "decode")

Steps: the instance stops admitting (routers in this process at once; elsewhere through the cluster
state's "draining") and its requests run to their end, as for a scale-down (`Controller.drain`);
the routers forget it (what is left after `timeout_s` is retried elsewhere); every rank rebuilds, the
followers first told, then rank 0, whose loop releases theirs; the instance registers again, same id,
new role and KV endpoints; routers take it in its new pool. Its prefix cache starts empty. A flip that
fails leaves the instance lost (its requests already went elsewhere): the supervisor replaces it.
"""
from __future__ import annotations

import logging
import time

from router.client import InstanceDeadError, InstanceInfo

logger = logging.getLogger(__name__)
FLIP_RANK_TIMEOUT_S = 120.0  # a rank's rebuild (no model load: its worker, KV ends and scheduler)


def flip_instance(ctl, instance_id: str, role: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Flips `instance_id` of `ctl` (the Controller: Controller.flip_instance, which imports this) to `role`
    while serving. Returns the seconds it took: draining, rebuilding, in all. Raises ValueError (one line)
    for an unknown instance, its own role, or a role the spec cannot run."""
    inst = ctl.instances.get(instance_id)
    if inst is None:
        raise ValueError(f"no instance {instance_id!r} (instances: {', '.join(sorted(ctl.instances))})")
    if role == inst.role:
        raise ValueError(f"{instance_id} is a {role} instance already")
    if role not in ("prefill", "decode") or ctl.spec.mode != "disaggregated":
        raise ValueError(f"a flip turns a prefill instance into a decode one or back, in a disaggregated cluster; "
                         f"got {role!r} in mode {ctl.spec.mode}")
    if ctl.spec.speculative is not None:
        raise ValueError("a flip rebuilds no speculative proposer: not with speculative decoding on")
    if ctl.spec.ray_resources and ctl.spec.worker_pods != "shared":
        raise ValueError(f"{instance_id} holds its worker pod's {inst.role} Ray resource (worker_pods per_role): "
                         "flips need worker_pods shared")
    if ctl.spec.tp_size(role) != inst.tp_size:
        raise ValueError(f"{instance_id} runs TP {inst.tp_size}; a {role} instance runs TP {ctl.spec.tp_size(role)}")
    start = time.monotonic()
    drained = ctl.drain(instance_id, timeout_s)
    ctl.membership.removed(instance_id)  # (what is left is retried elsewhere)
    drained_at = time.monotonic()
    try:
        endpoints = _rebuild(ctl, inst, role)
    except Exception as exc:
        logger.error("%s: the flip to %s failed (%s); the instance is lost and will be replaced", instance_id, role,
                     exc)
        ctl.mark_lost(instance_id, InstanceDeadError(instance_id, f"flip failed: {exc}"))
        raise
    old = inst.client.info
    info = InstanceInfo(instance_id, role, inst.tp_size, tuple(e for e in endpoints if e is not None),
                        max_model_len=old.max_model_len, block_size=old.block_size, engine=old.engine)
    inst.role, inst.client = role, _client(ctl, inst, info)
    ctl._register(inst)
    ctl.membership.added(inst)
    done = time.monotonic()
    logger.info("%s: now a %s instance (drained%s in %.2f s, rebuilt in %.2f s)", instance_id, role,
                "" if drained else " only partly", drained_at - start, done - drained_at)
    return {"drain_s": drained_at - start, "rebuild_s": done - drained_at, "total_s": done - start}


def _rebuild(ctl, inst, role: str) -> list:
    """Every rank rebuilt as `role` (followers told first: rank 0's loop releases theirs); their KV endpoints."""
    config = ctl.spec.engine_config(role)
    if not ctl.use_ray:
        (host,) = inst.ranks
        host.flip(role, config, FLIP_RANK_TIMEOUT_S)
        return [host.kv_endpoint()]
    import ray
    leader, followers = inst.ranks[0], inst.ranks[1:]
    ray.get([f.expect_flip.remote(role, config) for f in followers], timeout=60)
    waits = [f.flip.remote(role, config) for f in followers]
    endpoints = [ray.get(leader.flip.remote(role, config), timeout=FLIP_RANK_TIMEOUT_S),
                 *ray.get(waits, timeout=FLIP_RANK_TIMEOUT_S)]
    if followers:  # a decode's reservations and a prefill's fetches reach every rank's new worker
        ray.get(leader.set_followers.remote(followers), timeout=60)
    return endpoints


def _client(ctl, inst, info: InstanceInfo):
    if ctl.use_ray:
        return ctl._ray_client(info, inst.ranks[0])
    from cluster.control.serving import local_client
    return local_client(info, inst.ranks[0].worker)
