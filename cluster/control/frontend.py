"""A gateway's cluster when a controller elsewhere owns the instances (`pdserve gateway`): a
router over the instances it finds in the cluster state, and nothing else. Any number of these
run side by side; each gets exactly its own requests' tokens (outputs are addressed to its
router's id, engine/runner/worker_base.py) and publishes its request counters for the controller's autoscaler.

    every SYNC_S:  cluster state records  ->  healthy and new: attach (its rank-0 actor, by name)
                                              draining: no new requests
                                              dead, or gone for heartbeat_ttl_s: removed (its
                                              requests retried elsewhere)

An instance this router found dead itself (a call that timed out, a partition between this gateway
and it) stays out until the controller replaces it, or until the controller has heartbeated it for
heartbeat_ttl_s past that moment: then it answers the controller, so it is attached again anew.
"""
from __future__ import annotations

import logging
import math
import threading
import time

from engine.core import tracing
from cluster.control.serving import Serving, ray_client
from cluster.control.instance import Instance, init_ray, rank_actor_name
from cluster.ranks.nodes import RankPlacement
from cluster.spec import ClusterSpec
from cluster.state import ClusterState, InstanceRecord
from cluster.state_factory import create_state
from kvtransfer.params import KVEndpoint
from router.client import InstanceInfo
from router.policy import create_routing_policy
from router.router import Router

logger = logging.getLogger(__name__)
SYNC_S = 0.5
STATS_S = 1.0


LONG_POLL_S = 2.0  # a gateway's poll of an idle instance, at most (and a tenth of the spec's client TTL)


def create_router(spec: ClusterSpec, prefill: list, decode: list, long_poll_s: float | None = None) -> Router:
    """The router the spec asks for (a prefix-aware policy keeps its own index, fed by the prefill
    engines' KV events: router/prefix_index.py). `long_poll_s`: Router's (None: its poll_s)."""
    recompute = spec.kv_recompute_max_tokens if spec.kv_load_failure_policy == "recompute" else 0
    if spec.tracing is not None and not tracing.enabled():  # this process's spans (a test may have set its own)
        tracing.configure(spec.tracing)
    return Router(prefill, decode, create_routing_policy(spec.router_policy), mode=spec.mode,
                  disagg_threshold_tokens=spec.disagg_threshold_tokens, kv_recompute_max_tokens=recompute,
                  kv_fetch=spec.kv_fetch, max_queued=spec.router_max_queued,
                  queue_timeout_s=spec.router_queue_timeout_s, long_poll_s=long_poll_s)


def publish_stats(router: Router, state: ClusterState, stop: threading.Event, ttl_s: float) -> None:
    """Until `stop`: the router's counters (and queue length) into the cluster state every STATS_S."""
    while not stop.wait(STATS_S):
        try:
            state.publish_router(router.client_id, router.snapshot(), ttl_s)
        except Exception:  # the state store is down: serving goes on, say so
            logger.warning("cannot publish %s's counters to the cluster state", router.client_id, exc_info=True)


class Frontend(Serving):
    """A gateway's cluster over instances a controller owns. Needs a Ray cluster to join and a
    shared (Redis) cluster state."""

    def __init__(self, spec: ClusterSpec, state: ClusterState | None = None, log_level: str = "WARNING"):
        if spec.ray_address is None or (state is None and spec.redis_url is None):
            raise ValueError("a gateway without the controller needs --ray-address and --redis-url "
                             "(it finds the controller's instances through them)")
        super().__init__(spec, {}, state or create_state(spec.redis_url, spec.cluster_name))
        self.log_level = log_level
        self.autoscaler = None  # the controller runs it
        self._lost: dict[str, float] = {}  # ids this router found dead -> their record's updated_at then
        self._missing: set[str] = set()  # records without actors (logged once)
        self._absent: dict[str, float] = {}  # attached instances whose record vanished: since when
        self._version, self._read_at = -1, -math.inf  # the state's version when the records were last read
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Frontend:
        init_ray(self.spec, self.log_level)
        # (a gateway over many instances: idle ones are asked less often; in-process clusters keep poll_s,
        # so that closing one does not wait for the long polls)
        self.router = create_router(self.spec, [], [], min(LONG_POLL_S, self.spec.client_ttl_s / 10))
        self.router.start()
        self.sync()
        for target, args in ((self._sync_loop, ()),
                             (publish_stats, (self.router, self.state, self._stop, 3 * self.spec.heartbeat_ttl_s))):
            t = threading.Thread(target=target, args=args, daemon=True, name=f"frontend-{target.__name__}")
            t.start()
            self._threads.append(t)
        logger.info("gateway router %s: %d instances found", self.router.client_id, len(self.instances))
        return self

    def shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.router is not None:
            self.router.close()
        self.state.close()

    # -- membership from the cluster state -------------------------------------------------------
    def _sync_loop(self) -> None:
        while not self._stop.wait(SYNC_S):
            try:
                self.sync()
            except Exception:  # the state store is down: keep routing over what is known, say so
                logger.warning("cannot read the cluster state", exc_info=True)

    def sync(self) -> None:
        """Brings the router's instances in line with the cluster state's records: read again when
        the membership moved (the state's version: an instance registered, removed, its health
        changed), and every heartbeat TTL / 2 (an expiry, a restarted store, this router's own
        losses: what no version tells)."""
        now, version = time.monotonic(), self.state.version()
        if version == self._version and now - self._read_at < self.spec.heartbeat_ttl_s / 2:
            return
        self._version, self._read_at = version, now  # (before reading: a change meanwhile moves it again)
        records = {r.instance_id: r for r in self.state.list_instances()}
        for iid, inst in list(self.instances.items()):
            record = records.get(iid)
            if record is not None:
                self._absent.pop(iid, None)
            elif now - self._absent.setdefault(iid, now) < self.spec.heartbeat_ttl_s:
                continue  # a Redis that restarted empty: the controller registers it again within TTL / 3
            if record is None or record.health == "dead":
                logger.info("instance %s left the cluster", iid)
                self.instances.pop(iid)
                self._absent.pop(iid, None)
                self.router.remove_instance(iid)
            elif record.health == "draining" and not inst.client.info.draining:
                self.router.drain(iid)
            elif record.role != inst.role and record.health == "healthy":  # flipped (cluster/control/flip.py)
                logger.info("instance %s is a %s instance now", iid, record.role)
                self.instances.pop(iid)
                self.router.remove_instance(iid)
                self._attach(record)
            elif not inst.client.info.healthy:
                self._lost.setdefault(iid, record.updated_at)
        for iid, record in records.items():
            if iid in self._lost and record.health == "healthy" and iid in self.instances \
                    and record.updated_at - self._lost[iid] >= self.spec.heartbeat_ttl_s:
                self._readmit(record)
            elif record.health == "healthy" and iid not in self.instances and iid not in self._lost:
                self._attach(record)

    def _readmit(self, record: InstanceRecord) -> None:
        """An instance this router found dead that its controller has heartbeated for a TTL since
        (both times the controller's clock): a new client for it, as for one that joins."""
        iid = record.instance_id
        logger.warning("instance %s, found dead by this gateway, has answered the controller for %.1f s since: "
                       "attaching it again", iid, record.updated_at - self._lost.pop(iid))
        self.instances.pop(iid)
        self.router.remove_instance(iid)
        self._attach(record)

    def rank0_actor(self, instance_id: str):
        """The instance's rank-0 actor handle, found by name; ValueError when Ray has none by it."""
        import ray
        return ray.get_actor(rank_actor_name(instance_id, 0), namespace=self.spec.cluster_name)

    def _attach(self, record: InstanceRecord) -> None:
        iid = record.instance_id
        try:
            actor = self.rank0_actor(iid)
        except ValueError:  # registered before its actors were named (or already gone)
            if iid not in self._missing:
                logger.warning("instance %s is in the cluster state but has no actor in Ray namespace %s",
                               iid, self.spec.cluster_name)
                self._missing.add(iid)
            return
        endpoints = tuple(KVEndpoint(iid, rank, host, port) for rank, (host, port) in enumerate(record.kv_endpoints))
        info = InstanceInfo(iid, record.role, record.tp_size, endpoints, max_model_len=record.max_model_len,
                            block_size=record.block_size, engine=record.engine)
        client = ray_client(info, actor, self.spec.heartbeat_ttl_s)
        cpus = record.rank_cpus if len(record.rank_cpus) == len(record.ranks) else [{}] * len(record.ranks)
        placements = [RankPlacement(r, host, pid, cpu) for r, ((host, pid), cpu) in enumerate(zip(record.ranks, cpus))]
        self.instances[iid] = Instance(iid, record.role, record.tp_size, [actor], client, placements=placements)
        self.router.add_instance(client)
        logger.info("instance %s (%s, tp=%d) joined", iid, record.role, record.tp_size)

    def wait_ready(self, timeout_s: float) -> bool:
        """Tests and tools: until an instance of every needed role is known, or `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.ready()
