"""Starting instances (cluster/control/controller.py `_create`): on Ray, a node and a STRICT_PACK
placement group for the instance, then one RankActor per bundle, each set up (model loaded, TP group
joined) before the instance counts as started; and starting several instances at once.

At once or one after the other (`start_each`): an instance sizes its KV pool from what its device
has free, so instances that share a GPU start one at a time (cluster/control/gpu_share.py); ranks
that share no device (CPU processes, a GPU each) start together (BENCHMARKS.md "Cold start after
(issue 55 item 3)"). In-process instances (no Ray) start one after the other: one process's engines
share torch's global state while they load (the default dtype).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence, TypeVar

from cluster.control.instance import Instance, rank_actor_name
from cluster.control.rank_planner import RankPlanner
from cluster.ranks import nodes
from cluster.spec import ClusterSpec
from router.client import InstanceInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")


def start_each(calls: Sequence[Callable[[], T]], at_once: bool) -> list[T]:
    """Each call's result, in order. `at_once`: every call on a thread of its own, all waited for
    (none is left starting when this returns or raises); else one after the other, up to the first
    failure. Raises the first failure in the order of `calls`; the others are logged."""
    if not at_once or len(calls) < 2:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="controller-start") as pool:
        futures = [pool.submit(call) for call in calls]
    failures = [f.exception() for f in futures if f.exception() is not None]
    for other in failures[1:]:
        logger.error("another instance failed to start too: %s: %s", type(other).__name__, other)
    if failures:
        raise failures[0]
    return [f.result() for f in futures]


class RayStarter:
    """Starts an instance's ranks on Ray: what it needs of the controller is passed in (the spec, the
    rank planner, node placements, the Ray namespace, and a way to make an instance's client)."""

    def __init__(self, spec: ClusterSpec, planner: RankPlanner, placements: nodes.PlacementManager, namespace: str,
                 multihost: bool, log_level: str, make_client: Callable[[InstanceInfo, object], object]):
        self.spec, self.planner, self.placements, self.namespace = spec, planner, placements, namespace
        self.multihost, self.log_level, self.make_client = multihost, log_level, make_client

    @property
    def detached(self) -> bool:
        return self.multihost  # cluster/control/controller.py Controller.detached

    def start(self, role: str, iid: str, tp: int) -> Instance:
        """Chooses a node, reserves a STRICT_PACK placement group on it, starts the ranks there;
        on failure, what it reserved and started is released again."""
        import ray
        gpu = self.planner.use_gpus()
        per_rank = self.planner.rank_resources(role, gpu)
        pg_name = f"{self.namespace}/{iid}" if self.detached else ""
        node, pg = self.placements.place(iid, role, tp, per_rank, pg_name)
        actors: list = []
        try:
            return self._start_ranks(role, iid, tp, gpu, node, pg, actors)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            self.placements.release(iid, pg)
            self.planner.release_cores(iid)
            raise

    def _start_ranks(self, role: str, iid: str, tp: int, gpu: bool, node: nodes.NodeInfo, pg,
                     actors: list) -> Instance:
        """One RankActor per bundle of `pg` (appended to `actors` as they start); returns the ready instance."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from cluster.ranks.actor import RankActor
        planner, spec = self.planner, self.spec
        config, num_gpus = planner.engine_config(role, gpu, node), planner.rank_resources(role, gpu).get("GPU", 0)
        cpu_plans = planner.rank_cpu_plans(iid, tp, node)
        for r in range(tp):
            actors.append(RankActor.options(
                num_cpus=1, num_gpus=num_gpus, name=rank_actor_name(iid, r), namespace=self.namespace,
                lifetime="detached" if self.detached else None, runtime_env=planner.rank_runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)).remote(
                config, role, iid, r, tp, spec.kv_transfer_timeout_s, self.log_level, not self.multihost,
                spec.client_ttl_s, planner.kv_same_device(gpu), cpu_plans[r], kv_checksum=spec.kv_checksum,
                kv_transport=spec.kv_transport, trace_to=spec.tracing))
        start = time.monotonic()
        placements = ray.get([a.placement.remote() for a in actors], timeout=300)
        address = ray.get(actors[0].rendezvous_address.remote()) if tp > 1 else None
        logger.info("%s: %d rank actors up on %s (interface %s, pids %s) in %.1f s", iid, tp, placements[0].node_ip,
                    ray.get(actors[0].socket_interface.remote()), [p.pid for p in placements], time.monotonic() - start)
        endpoints = ray.get([a.setup.remote(address) for a in actors], timeout=600)
        placements = [replace(p, cpu=c) for p, c in zip(placements, ray.get([a.cpu.remote() for a in actors]))]
        logger.info("%s: ranks' CPUs %s", iid, [p.cpu for p in placements])
        engine = ray.get(actors[0].engine.remote())  # logged here: rank actors' own logs may not reach the driver
        logger.info("%s: ranks ready in %.1f s, engine %s", iid, time.monotonic() - start, engine)
        if tp > 1:  # a decode's reservations and a prefill's fetches reach every rank
            ray.get(actors[0].set_followers.remote(actors[1:]))
        ray.get(actors[0].mark_complete.remote())
        info = InstanceInfo(iid, role, tp, tuple(e for e in endpoints if e is not None),
                            max_model_len=ray.get(actors[0].max_model_len.remote()),
                            block_size=ray.get(actors[0].block_size.remote()), engine=engine)
        return Instance(iid, role, tp, actors, self.make_client(info, actors[0]), pg, placements=placements,
                        node_id=node.node_id)
