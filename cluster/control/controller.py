"""The controller: owns a cluster's instances. It creates them (cluster/ranks/nodes.py places them),
watches them, replaces the dead, drains and removes them; the autoscaler acts through it. Routers
(the gateways) find the instances in the cluster state; they never ask the controller.

    start: join or start Ray -> adopt the live instances of an earlier controller -> create the rest
    every heartbeat_ttl_s / 3: one load() call to every instance, all at once, each with a deadline
        answered  -> heartbeat + load into the cluster state
        silent / dead -> marked dead, its ranks killed, a replacement of its role started

Joined to a Ray cluster (`ray_address`), each rank is a detached Ray actor named
`<instance id>.rank<r>` in the Ray namespace `cluster_name`, in a detached placement group named
`<cluster_name>/<instance id>`: instances outlive this process, and a controller that starts adopts
the complete, ready ones of its spec (cluster/control/adopter.py) instead of starting new ones.
Otherwise (Ray started here, or in-process) instances live and die with this process.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time

from cluster.control import model_fit
from cluster.control.adopter import Adopter
from cluster.control.flip import flip_instance
from cluster.control.serving import local_client, ray_client
from cluster.control.instance import Instance, init_ray, rank_actor_name, setup_ray_auth  # noqa: F401 (re-exported)
from cluster.control.membership import Membership
from cluster.control.rank_planner import RankPlanner
from cluster.control.ray_start import RayStarter, start_each
from cluster.ranks import cpu_plan, nodes
from cluster.spec import ClusterSpec
from cluster.state import ClusterState, InstanceRecord
from cluster.state_factory import create_state
from router.client import InstanceDeadError, InstanceInfo, InstanceLoad

logger = logging.getLogger(__name__)
MASS_SILENCE_PROBES = 3  # probes in a row that must find most instances silent before they are dead
DRAIN_GRACE_S = 1.5  # gateways see a draining instance within their sync interval (cluster/control/frontend.py)


class Controller:
    def __init__(self, spec: ClusterSpec, state: ClusterState | None = None, use_ray: bool = True,
                 log_level: str = "WARNING", wait_for_room: bool = False, membership: Membership | None = None):
        """`wait_for_room`: an instance no node has room for yet is owed and retried (a node may
        join: `pdserve controller` before its worker pods), instead of failing `start()`.
        `membership`: what a router in this process is told of the instances (cluster/control/cluster.py)."""
        if not use_ray and (spec.prefill_tp > 1 or spec.decode_tp > 1):
            raise ValueError("tensor parallelism needs one process per rank: use_ray=True")
        if use_ray and (index := spec.device.partition("cuda:")[2]) not in ("", "0"):
            raise ValueError(f"--device {spec.device}: under Ray each rank's actor sees only the GPU Ray gave it, "
                             f"as cuda:0 (CUDA_VISIBLE_DEVICES), so cuda:{index} does not exist there; use --device "
                             "cuda (or auto) and choose a node's GPUs with CUDA_VISIBLE_DEVICES where Ray starts")
        self.spec, self.use_ray, self.log_level, self.wait_for_room = spec, use_ray, log_level, wait_for_room
        self.membership = membership or Membership()
        self.owed: list[str] = []  # roles of instances to start once a node has room
        self.state = state or create_state(spec.redis_url, spec.cluster_name)
        self.instances: dict[str, Instance] = {}
        self.adopted: list[str] = []  # instances found running at start (an earlier controller's)
        self.autoscaler = None  # cluster/autoscale/autoscale_loop.Autoscaler when the spec asks for one
        self._started_ray = False
        self._next_id = {"prefill": 0, "decode": 0, "colocated": 0}
        self._id_lock = threading.Lock()
        self._nodes = nodes.PlacementManager()
        self.planner = RankPlanner(spec, self.multihost)  # GPU plan, engine configs, pinned cores of the ranks
        self._start_lock = threading.Lock()  # one instance starts at a time on shared GPUs
        self._dead_ids: list[str] = []  # dead instances, kept in the cluster state as such until shutdown
        self.supervise_errors = 0  # faults the supervisor survived (pdserve_controller_supervise_errors_total)
        self.mass_silences = 0  # probes in a row that found most instances silent at once (_spare_the_silent)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # not joined: a namespace of our own, so leftovers of another cluster on this Ray never collide
        self._namespace = spec.cluster_name if self.detached else f"pdserve-{secrets.token_hex(4)}"
        self.adopter = Adopter(spec, self.state, self._namespace, self.planner, self._nodes, self._ray_client)
        self.starter = RayStarter(spec, self.planner, self._nodes, self._namespace, self.multihost, log_level,
                                  self._ray_client)

    @property
    def multihost(self) -> bool:
        """Joined a Ray cluster that may span hosts (ranks bind their node's address, checks on)."""
        return self.use_ray and self.spec.ray_address is not None

    @property
    def detached(self) -> bool:
        """Instances outlive this process (named, detached actors) and are adopted on start."""
        return self.multihost

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Controller:
        """Adopts or starts every instance; on failure, what this call started is stopped again."""
        model_fit.check(self.spec)  # before anything starts
        if self.use_ray:
            cpu_plan.check_host_cores(self.spec)
        try:
            if self.use_ray:
                ranks = sum(n * self.spec.tp_size(r) for r, n in self.spec.instance_counts.items())
                self._started_ray = init_ray(self.spec, self.log_level, ranks)
                if self.planner.use_gpus():
                    self.planner.gpu_plan()  # refuses what the GPUs cannot hold before anything starts
            if self.multihost:
                self._check_unique_addresses()
            if self.detached:
                self._adopt()
            self._create_missing()
            if self.multihost:
                nodes.check_network(list(self.instances.values()))
            self.membership.started()
        except BaseException:
            self.shutdown(stop_instances=True, adopted_too=False)
            raise
        self._spawn(self._supervise)
        up = ", ".join(f"{i.instance_id} (tp={i.tp_size})" for i in self.instances.values())
        logger.info("instances up: %s%s", up, f" ({len(self.adopted)} adopted)" if self.adopted else "")
        return self

    def _create_missing(self) -> None:
        """Starts the instances of the spec that are not up (adopted): at once where they share no
        device (`starts_at_once`), else one after the other, each set up (its KV pool sized) before
        the next starts, decode first on shared GPUs (gpu_share.GpuPlan.start_order says why). An
        instance no node has room for is owed (`wait_for_room`), in the spec's order."""
        counts = self.spec.instance_counts
        plan = self.planner.plan
        order = plan.start_order if plan is not None else tuple(counts)
        up = [i.role for i in self.instances.values()]
        roles = [role for role in order for _ in range(counts[role] - up.count(role))]
        placed = start_each([functools.partial(self._create_or_owe, role) for role in roles], self.starts_at_once)
        self.owed += [role for role, ok in zip(roles, placed) if not ok]

    @property
    def starts_at_once(self) -> bool:
        """Whether instances start in parallel: ranks in processes of their own (Ray) that share no
        device (CPUs, or a GPU each); not on shared GPUs, nor in this process (cluster/control/ray_start.py)."""
        return self.use_ray and not (self.planner.plan is not None and self.planner.plan.shared)

    def _create_or_owe(self, role: str) -> bool:
        """Starts one instance of `role`; False: no node has room for it yet, and `wait_for_room`."""
        try:
            self._create(role)
            return True
        except nodes.PlacementError as exc:
            if not self.wait_for_room:
                raise
            logger.warning("%s; waiting for a node with room", exc)
            return False

    def _check_unique_addresses(self, wait_s: float = 60.0) -> None:
        """Among the nodes that can run ranks (drivers' nodes have no CPUs). A node restarted in
        place shows twice until Ray declares its old self dead (~15 s): retried for `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return nodes.check_unique_addresses(
                    n for n in nodes.alive_nodes() if n.resources.get("CPU", 0) > 0 or n.resources.get("GPU", 0) > 0)
            except ValueError as exc:
                if time.monotonic() > deadline:
                    raise
                logger.warning("%s; waiting for Ray to declare the older one dead", exc)
                time.sleep(2)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"controller-{target.__name__}")
        t.start()
        self._threads.append(t)

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self, stop_instances: bool = True, adopted_too: bool = True) -> None:
        """Stops watching. `stop_instances`: also stop every instance (else, joined to Ray, they
        keep serving and the next controller adopts them); `adopted_too=False` spares the adopted."""
        if self.autoscaler is not None:
            self.autoscaler.close()
        self._stop.set()
        self.membership.stopping()
        for t in self._threads:
            t.join(timeout=5)
        if stop_instances:
            for iid in list(self.instances):
                if adopted_too or iid not in self.adopted:
                    self._destroy(self.instances.pop(iid))
            for iid in self._dead_ids:
                self.state.remove(iid)
        if self._started_ray:
            import ray
            ray.shutdown()
        self.state.close()

    def mark_lost(self, instance_id: str, exc: Exception) -> None:
        """The instance stopped answering: a router in this process retries its requests; the
        supervisor replaces it."""
        self.membership.lost(instance_id, exc)  # first: a router retries only what runs on a healthy one
        self.instances[instance_id].client.info.healthy = False

    def _is_drained(self, inst: Instance) -> bool:
        """No request runs or waits on the instance: none a router in this process holds there,
        none in its own counters."""
        return not self.membership.busy(inst.instance_id) and InstanceLoad.of(inst.client.load()).idle

    # -- membership ------------------------------------------------------------------------------
    def add_instance(self, role: str) -> str:
        """Start one more instance of `role` while serving; routers use it from now on."""
        inst = self._create(role)
        if self.multihost:
            try:
                nodes.check_network(list(self.instances.values()), inst)
            except ValueError:
                self.instances.pop(inst.instance_id)
                self._destroy(inst)
                raise
        self.membership.added(inst)
        return inst.instance_id

    def remove_instance(self, instance_id: str, dead: bool = False) -> None:
        """Take an instance out while serving: no new requests go there, its in-flight requests
        are retried elsewhere, then its ranks stop (`dead`: see `_destroy`)."""
        inst = self.instances.pop(instance_id)
        self.membership.removed(instance_id)
        self._destroy(inst, dead)

    def drain_instance(self, instance_id: str, timeout_s: float = 120.0) -> bool:
        """Scale-down: `drain`, then remove it. False: `timeout_s` ran out first (the rest is retried elsewhere)."""
        drained = self.drain(instance_id, timeout_s)
        self.remove_instance(instance_id)
        return drained

    def flip_instance(self, instance_id: str, role: str, timeout_s: float = 120.0) -> dict[str, float]:
        """Changes an instance's role in place (cluster/control/flip.py): the seconds it took."""
        return flip_instance(self, instance_id, role, timeout_s)

    def drain(self, instance_id: str, timeout_s: float) -> bool:
        """No new requests go there (other gateways see it within DRAIN_GRACE_S): whether its own end in `timeout_s`."""
        inst = self.instances[instance_id]
        inst.client.info.draining = True
        self._set_health(instance_id, "draining")
        self.membership.draining(instance_id)
        deadline = time.monotonic() + timeout_s
        if self.detached:
            time.sleep(DRAIN_GRACE_S)
        while True:
            try:
                drained = self._is_drained(inst)
            except InstanceDeadError:
                drained = False
                break
            if drained or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not drained:
            logger.warning("%s not drained after %.0f s; its remaining requests are retried elsewhere",
                           instance_id, timeout_s)
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

    # -- the view (router/view.py) ---------------------------------------------------------------
    def instance_infos(self) -> list[InstanceInfo]:
        return [i.info() for i in list(self.instances.values())]

    def instance_status(self) -> list[dict]:
        return [{**i.status(), "adopted": i.instance_id in self.adopted} for i in list(self.instances.values())]

    def router_stats(self) -> dict[str, dict[str, float]]:
        """Every live router's (gateway's) request counters, as published in the cluster state."""
        return self.state.router_stats()

    # -- creating and adopting -------------------------------------------------------------------
    def _create(self, role: str) -> Instance:
        with self._id_lock:  # instances start at once (`_create_missing`), additions race
            iid = f"{role}-{self._next_id[role]}"
            self._next_id[role] += 1
        tp = self.spec.tp_size(role)
        # NOTE: additions may race (autoscaler, replacements); on shared GPUs they wait for each other,
        # so that two ranks' weight loading and CUDA graph capture (outside the per-rank memory
        # budgets: only the GPU's slack above gpu_memory_utilization holds them) never overlap.
        shared = self.planner.plan is not None and self.planner.plan.shared
        with self._start_lock if shared else contextlib.nullcontext():
            inst = self._create_ray(role, iid, tp) if self.use_ray else self._create_local(role, iid)
        self.instances[iid] = inst
        self._register(inst)
        return inst

    def _register(self, inst: Instance) -> None:
        info = inst.client.info
        self.state.register(InstanceRecord(inst.instance_id, inst.role, inst.tp_size,
                                           [(e.host, e.port) for e in info.kv_endpoints],
                                           max_model_len=info.max_model_len, block_size=info.block_size,
                                           ranks=[(p.node_ip, p.pid) for p in inst.placements], engine=info.engine,
                                           rank_cpus=[p.cpu for p in inst.placements]))

    def _create_local(self, role: str, iid: str) -> Instance:
        from cluster.ranks.rank import RankHost
        host = RankHost(self.spec.engine_config(role), role, iid, kv_timeout_s=self.spec.kv_transfer_timeout_s,
                        client_ttl_s=self.spec.client_ttl_s, kv_same_device=self.planner.kv_same_device(False),
                        kv_checksum=self.spec.kv_checksum, kv_transport=self.spec.kv_transport,
                        on_loop_death=lambda: self._loop_died(iid))
        ep = host.kv_endpoint()
        info = InstanceInfo(iid, role, 1, (ep,) if ep else (), max_model_len=host.max_model_len,
                            block_size=host.block_size, engine=host.engine)
        client = local_client(info, host.worker)
        runner = host.runner
        cpu = cpu_plan.cpu_state(host.step_thread_id, runner.intraop_threads, runner.team is not None)
        placement = nodes.RankPlacement(0, nodes.LOOPBACK, os.getpid(), cpu)
        return Instance(iid, role, 1, [host], client, placements=[placement])

    def _loop_died(self, iid: str) -> None:
        """An in-process rank's step loop died (a Ray rank's process exits instead): the instance
        is lost, as if it stopped answering, so its requests are retried and it is replaced."""
        if iid in self.instances:
            self.mark_lost(iid, InstanceDeadError(iid, "its step loop died"))

    def _create_ray(self, role: str, iid: str, tp: int) -> Instance:
        return self.starter.start(role, iid, tp)

    def _adopt(self) -> None:
        """The instances an earlier controller left in this namespace become this one's."""
        found = self.adopter.adopt()
        self.instances.update(found.instances)
        self.adopted += list(found.instances)
        for inst in found.unregistered:
            self._register(inst)
        for iid in found.seen_ids:
            self._note_id(iid)

    def _ray_client(self, info: InstanceInfo, actor):
        return ray_client(info, actor, self.spec.heartbeat_ttl_s)

    def _note_id(self, iid: str) -> None:
        role, _, n = iid.rpartition("-")
        if role in self._next_id and n.isdigit():
            with self._id_lock:
                self._next_id[role] = max(self._next_id[role], int(n) + 1)

    # -- watching --------------------------------------------------------------------------------
    def _supervise(self, retry_s: float = 5.0) -> None:
        """Every heartbeat_ttl_s / 3: probes every instance (heartbeat + load into the cluster
        state); one found dead (by the probe, or by a router in this process) is removed, marked
        dead in the cluster state, and a new one of its role started, so the pools keep their
        sizes: on another node if one has room (its node is suspect), else on its own, and while
        no node has room, tried again every `retry_s` (a node may join)."""
        owed = self.owed  # roles whose (replacement) instance could not start yet
        last_try = time.monotonic() if owed else 0.0
        ttl = self.spec.heartbeat_ttl_s
        while not self._stop.wait(ttl / 3):
            try:
                self._probe_all(ttl)
                self._replace_dead(owed)
            except Exception:  # NOTE: this thread must outlive any fault (a Redis cut mid-call): say so, go on
                self.supervise_errors += 1
                logger.exception("supervising the instances failed (%d so far); retrying", self.supervise_errors)
            if owed and time.monotonic() - last_try >= retry_s:
                last_try = time.monotonic()
                try:
                    logger.info("owed %s instance started: %s", owed[0], self.add_instance(owed[0]))
                    owed.pop(0)
                except Exception as exc:  # no room in Ray, model load failed: keep serving, say so
                    logger.warning("cannot start the owed %s instance yet (retry in %.0f s): %s",
                                   owed[0], retry_s, exc)

    def _replace_dead(self, owed: list[str]) -> None:
        """Every dead instance removed (marked dead) and its role owed a new one."""
        for iid, inst in list(self.instances.items()):
            if not self.spec.replace_dead_instances:
                break
            if not (inst.client.info.healthy or inst.client.info.draining):
                logger.warning("instance %s is dead; replacing it", iid)
                self._nodes.suspect(inst.node_id)
                owed.append(inst.role)  # first: what follows may fail, and the pool must not shrink
                self.remove_instance(iid, dead=True)

    def _probe_all(self, ttl: float) -> None:
        """One load() call to every healthy instance at once; an instance dead, or silent for
        `ttl` seconds, is lost. The answers are the heartbeats and loads of the cluster state."""
        live = [i for i in list(self.instances.values()) if i.client.info.healthy]
        answers: dict[str, dict | Exception] = {}
        if self.use_ray:
            import ray
            refs = {i.instance_id: i.ranks[0].load.remote() for i in live}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=ttl) if refs else ([], [])
            for iid, ref in refs.items():
                try:
                    answers[iid] = ray.get(ref, timeout=0) if ref in ready else TimeoutError(f"silent for {ttl:g} s")
                except ray.exceptions.RayError as exc:
                    answers[iid] = exc
        else:
            answers = {i.instance_id: i.client.load() for i in live}
        self._spare_the_silent(answers)
        loads = {}
        for iid, answer in answers.items():
            if iid not in self.instances:
                continue
            if isinstance(answer, Exception):
                logger.error("instance %s does not answer (%s)", iid, type(answer).__name__)
                self.mark_lost(iid, InstanceDeadError(iid, type(answer).__name__))
                continue
            self.instances[iid].client.info.load = InstanceLoad.of(answer)
            loads[iid] = answer
        try:
            missing = self.state.report(loads, ttl)  # (every heartbeat and load in one round trip)
            for iid in missing:  # the state lost it (a Redis restarted without persistence)
                if (inst := self.instances.get(iid)) is not None:
                    logger.warning("%s is missing from the cluster state: registering it again", iid)
                    self._register(inst)
                    self.state.report({iid: loads[iid]}, ttl)
        except Exception:  # the state store is down: serving goes on, say so
            logger.warning("cannot publish %d instances' heartbeats to the cluster state", len(loads), exc_info=True)

    def _spare_the_silent(self, answers: dict) -> None:
        """Most instances silent in one probe (more than half, three or more) says more of this
        controller's view (its host overloaded, its link cut) than of them: they are not declared dead
        (and replaced, all at once) before MASS_SILENCE_PROBES probes in a row found it so. An answer
        that says an instance is dead (its actor gone) counts as ever."""
        silent = [iid for iid, answer in answers.items() if isinstance(answer, TimeoutError)]
        if len(silent) < 3 or 2 * len(silent) <= len(answers):
            self.mass_silences = 0
            return
        self.mass_silences += 1
        if self.mass_silences >= MASS_SILENCE_PROBES:
            logger.error("%d of %d instances silent in %d probes in a row: declaring them dead", len(silent),
                         len(answers), self.mass_silences)
            return
        logger.error("%d of %d instances silent in one probe: suspecting this controller's view (overloaded, cut "
                     "off), not them; dead only if %d probes in a row find it so", len(silent), len(answers),
                     MASS_SILENCE_PROBES)
        for iid in silent:
            del answers[iid]

    # -- internals -------------------------------------------------------------------------------
    def _set_health(self, instance_id: str, health: str) -> None:
        try:
            self.state.set_health(instance_id, health)
        except KeyError:
            pass

    def _call(self, inst: Instance, method: str):
        if self.use_ray:
            import ray
            return ray.get(getattr(inst.ranks[0], method).remote(), timeout=30)
        return getattr(inst.ranks[0], method)()  # an in-process RankHost: its worker's

    def _destroy(self, inst: Instance, dead: bool = False) -> None:
        """Stops the instance's ranks and frees its node. A `dead` one keeps its record in the
        cluster state, marked dead (until shutdown), and is not asked to stop: it cannot answer."""
        if dead:
            self._dead_ids.append(inst.instance_id)
        try:
            if dead:
                self.state.set_health(inst.instance_id, "dead")
            else:
                self.state.remove(inst.instance_id)
        except KeyError:
            pass
        except Exception as exc:  # the state store unreachable: the ranks still stop; its heartbeat expires
            logger.warning("cannot record %s as %s in the cluster state (%s); its heartbeat will expire",
                           inst.instance_id, "dead" if dead else "removed", exc)
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
        self.planner.release_cores(inst.instance_id)
