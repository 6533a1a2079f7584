"""The cluster: prefill and decode instances (each a TP group of rank hosts), the router over
them, cluster state, and an offline `generate` API.

    Cluster(spec).start()
      start or join Ray (token auth on)      -> one STRICT_PACK placement group per instance, pinned to
                                                the node cluster/nodes.py chooses (a bundle per rank)
      RankActor per rank: setup(rendezvous)  -> model loaded, TP group joined, KV endpoint returned
      joined Ray: every decode KV endpoint reachable from every prefill node, or a one-line error
      Router(prefill clients, decode clients, policy)  -> generate() / submit() go through it

With `use_ray=False` the instances run in this process (tp=1 only): quick tests and tools.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

from cluster import nodes
from cluster.clients import LocalDecodeClient, LocalPrefillClient, RayDecodeClient, RayPrefillClient
from cluster.spec import ClusterSpec
from cluster.state import ClusterState, InstanceRecord, create_state
from engine.block_manager import block_hashes
from engine.request import SamplingParams
from router.client import InstanceInfo
from router.policy import create_routing_policy
from router.router import Router
from router.stream import RequestStream

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    instance_id: str
    role: str
    tp_size: int
    ranks: list  # RankHost (in-process) or RankActor handles, rank order
    client: object
    placement_group: object = None
    extra: dict = field(default_factory=dict)
    placements: list[nodes.RankPlacement] = field(default_factory=list)  # rank order
    node_id: str | None = None  # the Ray node all its ranks run on (None in-process)


def setup_ray_auth() -> None:
    """Token authentication for a local Ray cluster: on, with a fresh per-cluster token unless the
    operator provided one (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH). Nothing is written to ~/.ray."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not (os.environ.get("RAY_AUTH_TOKEN")
                                                       or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # NOTE: Ray caches its config (auth mode included) when imported; re-read it from the env.
    from ray._raylet import Config
    Config.initialize("")


class Cluster:
    def __init__(self, spec: ClusterSpec, state: ClusterState | None = None, use_ray: bool = True,
                 log_level: str = "WARNING"):
        if not use_ray and (spec.prefill_tp > 1 or spec.decode_tp > 1):
            raise ValueError("tensor parallelism needs one process per rank: use_ray=True")
        self.spec, self.use_ray, self.log_level = spec, use_ray, log_level
        self.state = state or create_state(spec.redis_url)
        self.instances: dict[str, Instance] = {}
        self.router: Router | None = None
        self.autoscaler = None  # cluster/autoscale_loop.Autoscaler when the spec asks for one
        self._started_ray = False
        self._next_id = {"prefill": 0, "decode": 0, "colocated": 0}
        self._nodes = nodes.PlacementManager()
        self._dead_ids: list[str] = []  # dead instances, kept in the cluster state as such until shutdown

    @property
    def multihost(self) -> bool:
        """Joined a Ray cluster that may span hosts (ranks bind their node's address, checks on)."""
        return self.use_ray and self.spec.ray_address is not None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Starts every instance and the router; on failure, what was started is stopped again."""
        try:
            if self.use_ray:
                self._init_ray()
            if self.multihost:
                nodes.check_unique_addresses(nodes.alive_nodes())
            for role, n in self.spec.instance_counts.items():
                for _ in range(n):
                    self._create(role)
            if self.multihost:
                nodes.check_network(list(self.instances.values()))
        except BaseException:
            self.shutdown()
            raise
        policy_kw = {"cached_prefix": self._cached_prefix, "record": self._record_prefix} \
            if self.spec.router_policy == "prefix_aware" else {}
        by_role = lambda *roles: [i.client for i in self.instances.values() if i.role in roles]  # noqa: E731
        self.router = Router(by_role("prefill"), by_role("decode", "colocated"),
                             create_routing_policy(self.spec.router_policy, **policy_kw), mode=self.spec.mode,
                             disagg_threshold_tokens=self.spec.disagg_threshold_tokens)
        self.router.start()
        self._stop_publishing = threading.Event()
        threading.Thread(target=self._publish_state, daemon=True, name="cluster-state").start()
        if self.spec.replace_dead_instances:
            threading.Thread(target=self._replace_dead, daemon=True, name="cluster-supervisor").start()
        logger.info("cluster up: %s", ", ".join(f"{i.instance_id} (tp={i.tp_size})" for i in self.instances.values()))
        return self

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.close()
        if self.router is not None:
            self._stop_publishing.set()
            self.router.close()
        for iid in list(self.instances):
            self._destroy(self.instances.pop(iid))
        for iid in self._dead_ids:
            self.state.remove(iid)
        if self._started_ray:
            import ray
            ray.shutdown()
        self.state.close()

    # -- serving ---------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               listener=None) -> RequestStream:
        return self.router.submit(request_id, prompt_token_ids, params, listener)

    def abort(self, request_id: str) -> None:
        """Stop a request on every instance it touches; its blocks are freed."""
        self.router.abort(request_id)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output every instance can hold."""
        return min(i.client.info.max_model_len for i in self.instances.values())

    def ready(self) -> bool:
        """At least one healthy decode instance and, when disaggregated, one healthy prefill."""
        infos = [i.client.info for i in self.instances.values() if i.client.info.healthy]
        has = lambda *roles: any(i.role in roles for i in infos)  # noqa: E731
        return self.router is not None and has("decode", "colocated") and (self.spec.mode == "colocated"
                                                                           or has("prefill"))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 timeout_s: float | None = 600.0) -> list[RequestStream]:
        """All prompts at once through the router; returns their finished streams in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        streams = [self.submit(f"gen-{time.monotonic_ns()}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        return [s.result(timeout=timeout_s) for s in streams]

    # -- membership ------------------------------------------------------------------------------
    def add_instance(self, role: str) -> str:
        """Start one more instance of `role` while serving; the router uses it from now on."""
        inst = self._create(role)
        if self.multihost:
            try:
                nodes.check_network(list(self.instances.values()), inst)
            except ValueError:
                self.instances.pop(inst.instance_id)
                self._destroy(inst)
                raise
        self.router.add_instance(inst.client)
        return inst.instance_id

    def remove_instance(self, instance_id: str, dead: bool = False) -> None:
        """Take an instance out while serving: no new requests go there, its in-flight requests
        are retried elsewhere, then its ranks stop (`dead`: see `_destroy`)."""
        inst = self.instances.pop(instance_id)
        self.router.remove_instance(instance_id)
        self._destroy(inst, dead)

    def drain_instance(self, instance_id: str, timeout_s: float = 120.0) -> bool:
        """Scale-down: no new requests go to the instance, the running ones finish, then it is
        removed. Returns False when `timeout_s` ran out first (what was left is retried elsewhere)."""
        self.router.drain(instance_id)
        deadline = time.monotonic() + timeout_s
        while not (drained := self.router.is_drained(instance_id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not drained:
            logger.warning("%s not drained after %.0f s; its remaining requests are retried elsewhere",
                           instance_id, timeout_s)
        self.remove_instance(instance_id)
        return drained

    def kill_instance(self, instance_id: str) -> None:
        """Kill an instance's processes without telling anyone (failure testing)."""
        import ray
        for actor in self.instances[instance_id].ranks:
            ray.kill(actor, no_restart=True)

    def assert_no_leaks(self, timeout_s: float = 15.0) -> None:
        """Every live instance's allocator ends with all blocks free (releases are asynchronous)."""
        deadline = time.monotonic() + timeout_s
        for inst in self.instances.values():
            if not inst.client.info.healthy:
                continue
            while True:
                try:
                    self._call(inst, "assert_no_leaks")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    # -- internals -------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        if self.spec.ray_address is None:
            setup_ray_auth()
        import ray
        if ray.is_initialized():
            return
        if self.spec.ray_address is None:
            ranks = sum(n * self.spec.tp_size(r) for r, n in self.spec.instance_counts.items())
            ray.init(num_cpus=max(os.cpu_count() or 1, ranks + 2), include_dashboard=False,
                     logging_level=self.log_level, log_to_driver=self.log_level == "DEBUG")
        else:
            ray.init(address=self.spec.ray_address, logging_level=self.log_level)
        self._started_ray = True

    def _create(self, role: str) -> Instance:
        iid = f"{role}-{self._next_id[role]}"
        self._next_id[role] += 1
        tp = self.spec.tp_size(role)
        inst = self._create_ray(role, iid, tp) if self.use_ray else self._create_local(role, iid)
        self.instances[iid] = inst
        eps = [(e.host, e.port) for e in inst.client.info.kv_endpoints]
        self.state.register(InstanceRecord(iid, role, tp, eps))
        return inst

    def _create_local(self, role: str, iid: str) -> Instance:
        from cluster.rank import RankHost
        host = RankHost(self.spec.engine_config(role), role, iid, kv_timeout_s=self.spec.kv_transfer_timeout_s,
                        client_ttl_s=self.spec.client_ttl_s)
        ep = host.kv_endpoint()
        info = InstanceInfo(iid, role, 1, (ep,) if ep else (), max_model_len=host.max_model_len)
        client = (LocalPrefillClient if role == "prefill" else LocalDecodeClient)(info, host.worker)
        return Instance(iid, role, 1, [host], client, placements=[nodes.RankPlacement(0, nodes.LOOPBACK, os.getpid())])

    def _create_ray(self, role: str, iid: str, tp: int) -> Instance:
        """Chooses a node, reserves a STRICT_PACK placement group on it, starts the ranks there."""
        import ray
        gpu = self._use_gpus()
        node, pg = self._nodes.place(iid, role, tp, nodes.rank_resources(role, gpu, self.spec.ray_resources))
        actors: list = []
        try:
            return self._start_ranks(role, iid, tp, gpu, node, pg, actors)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            self._nodes.release(iid, pg)
            raise

    def _start_ranks(self, role: str, iid: str, tp: int, gpu: bool, node: nodes.NodeInfo, pg,
                     actors: list) -> Instance:
        """One RankActor per bundle of `pg` (appended to `actors` as they start); returns the ready instance."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from cluster.actor import RankActor
        config = self._engine_config(role, gpu, node)
        actors += [RankActor.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=
                                     PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)).remote(
            config, role, iid, r, tp, self.spec.kv_transfer_timeout_s, self.log_level, not self.multihost,
            self.spec.client_ttl_s)
            for r in range(tp)]
        start = time.monotonic()
        placements = ray.get([a.placement.remote() for a in actors], timeout=300)
        address = ray.get(actors[0].rendezvous_address.remote()) if tp > 1 else None
        logger.info("%s: %d rank actors up on %s (interface %s, pids %s) in %.1f s", iid, tp, placements[0].node_ip,
                    ray.get(actors[0].socket_interface.remote()), [p.pid for p in placements], time.monotonic() - start)
        endpoints = ray.get([a.setup.remote(address) for a in actors], timeout=600)
        logger.info("%s: ranks ready in %.1f s", iid, time.monotonic() - start)
        if role == "decode" and tp > 1:
            ray.get(actors[0].set_followers.remote(actors[1:]))
        info = InstanceInfo(iid, role, tp, tuple(endpoints) if role == "decode" else (),
                            max_model_len=ray.get(actors[0].max_model_len.remote()))
        client = (RayPrefillClient if role == "prefill" else RayDecodeClient)(info, actors[0],
                                                                              self.spec.heartbeat_ttl_s)
        return Instance(iid, role, tp, actors, client, pg, placements=placements, node_id=node.node_id)

    def _engine_config(self, role: str, gpu: bool, node: nodes.NodeInfo):
        config = self.spec.engine_config(role)
        if config.num_threads is None and not gpu:  # share the node's cores among the ranks, not oversubscribe
            ranks = sum(n * self.spec.tp_size(r) for r, n in self.spec.instance_counts.items())
            cores = node.resources.get("CPU", 1) if self.multihost else os.cpu_count() or 1
            config = replace(config, num_threads=max(1, int(cores) // ranks))
        return config

    def _use_gpus(self) -> bool:
        import ray
        if self.spec.device == "cpu":
            return False
        return self.spec.device.startswith("cuda") or ray.cluster_resources().get("GPU", 0) > 0

    def _call(self, inst: Instance, method: str):
        if self.use_ray:
            import ray
            return ray.get(getattr(inst.ranks[0], method).remote(), timeout=30)
        host = inst.ranks[0]
        worker = host.worker
        kv = worker.scheduler.kv if inst.role == "prefill" else worker.engine.kv
        return kv.assert_no_leaks()

    def _destroy(self, inst: Instance, dead: bool = False) -> None:
        """Stops the instance's ranks and frees its node. A `dead` one keeps its record in the
        cluster state, marked dead (until shutdown), and is not asked to stop: it cannot answer."""
        try:
            self.state.drop_instance_hashes(inst.instance_id)
            if dead:
                self.state.set_health(inst.instance_id, "dead")
                self._dead_ids.append(inst.instance_id)
            else:
                self.state.remove(inst.instance_id)
        except KeyError:
            pass
        if not self.use_ray:
            inst.ranks[0].shutdown()
            return
        import ray
        try:
            if not dead:
                ray.get(inst.ranks[0].shutdown.remote(), timeout=10)
        except Exception:  # already dead: nothing to stop
            pass
        for actor in inst.ranks:
            ray.kill(actor, no_restart=True)
        self._nodes.release(inst.instance_id, inst.placement_group)

    def _publish_state(self) -> None:
        """Heartbeats (TTL `heartbeat_ttl_s`), health and the router's load figures into the
        cluster state, so other processes (a second gateway, `pdserve status`, autoscalers) see them."""
        ttl = self.spec.heartbeat_ttl_s
        while not self._stop_publishing.wait(ttl / 3):
            for inst in list(self.instances.values()):
                info = inst.client.info
                try:
                    if info.healthy:
                        self.state.heartbeat(inst.instance_id, ttl)
                        self.state.update_load(inst.instance_id, info.load)
                    else:
                        self.state.set_health(inst.instance_id, "dead")
                except KeyError:  # removed meanwhile
                    pass
                except Exception:  # the state store is down: serving goes on, say so
                    logger.warning("cannot publish %s to the cluster state", inst.instance_id, exc_info=True)

    def _replace_dead(self, retry_s: float = 5.0) -> None:
        """An instance the router found dead (its requests already retried elsewhere) is removed,
        marked dead in the cluster state, and a new one of its role started, so the pools keep
        their sizes: on another node if one has room (its node is suspect), else on its own, and
        while no node has room, tried again every `retry_s` (a node may join)."""
        owed: list[str] = []  # roles whose replacement could not start yet
        last_try = 0.0
        while not self._stop_publishing.wait(0.5):
            for iid, inst in list(self.instances.items()):
                if not (inst.client.info.healthy or inst.client.info.draining):
                    logger.warning("instance %s is dead; replacing it", iid)
                    self._nodes.suspect(inst.node_id)
                    self.remove_instance(iid, dead=True)
                    owed.append(inst.role)
            if owed and time.monotonic() - last_try >= retry_s:
                last_try = time.monotonic()
                try:
                    logger.info("replacement %s instance: %s", owed[0], self.add_instance(owed[0]))
                    owed.pop(0)
                except Exception as exc:  # no room in Ray, model load failed: keep serving, say so
                    logger.warning("cannot start a replacement %s instance yet (retry in %.0f s): %s",
                                   owed[0], retry_s, exc)

    def _cached_prefix(self, prompt_token_ids: list[int]) -> dict[str, int]:
        return self.state.longest_prefix(block_hashes(prompt_token_ids, self.spec.block_size), role="prefill")

    def _record_prefix(self, instance_id: str, prompt_token_ids: list[int]) -> None:
        self.state.add_block_hashes(instance_id, block_hashes(prompt_token_ids, self.spec.block_size))
