"""The cluster in one process: a controller (cluster/control/controller.py: the instances) and a router
over them, plus an offline `generate` API. `pdserve serve` and the tests use it.

    Cluster(spec).start()
      Controller.start: Ray, instances (adopted or started), start-up checks
      Router(prefill clients, decode clients, policy)  -> generate() / submit() go through it
      its counters -> cluster state (the autoscaler reads every router's, this one's included)

The controller tells the router of its instances through explicit callbacks (cluster/control/membership.py):
one joins, drains, leaves or stops answering. Other gateways (cluster/control/frontend.py) may route over
the same instances through the cluster state. With `use_ray=False` the instances run in this process (tp=1
only): quick tests and tools.
"""
from __future__ import annotations

import threading

from cluster.control.controller import Controller
from cluster.control.frontend import create_router, publish_stats
from cluster.control.membership import Membership
from cluster.control.serving import Serving
from cluster.spec import ClusterSpec
from cluster.state import ClusterState


class Cluster(Serving):
    def __init__(self, spec: ClusterSpec, state: ClusterState | None = None, use_ray: bool = True,
                 log_level: str = "WARNING", wait_for_room: bool = False):
        membership = Membership(started=self._route, added=lambda inst: self.router.add_instance(inst.client),
                                draining=lambda iid: self.router.drain(iid), removed=self._forget,
                                lost=self._lost, stopping=self._stop_routing,
                                busy=lambda iid: self.router is not None and not self.router.is_drained(iid))
        self.controller = Controller(spec, state, use_ray, log_level, wait_for_room, membership)
        super().__init__(spec, self.controller.instances, self.controller.state)
        self._stop = threading.Event()

    # -- the router follows the controller's membership ------------------------------------------
    def _route(self) -> None:
        by_role = lambda *roles: [i.client for i in self.instances.values() if i.role in roles]  # noqa: E731
        self.router = create_router(self.spec, by_role("prefill"), by_role("decode", "colocated"))
        self.router.start()
        ttl = 3 * self.spec.heartbeat_ttl_s
        threading.Thread(target=publish_stats, args=(self.router, self.state, self._stop, ttl),
                         daemon=True, name="cluster-stats").start()

    def _forget(self, instance_id: str) -> None:
        if self.router is not None:
            self.router.remove_instance(instance_id)

    def _lost(self, instance_id: str, exc: Exception) -> None:
        if self.router is not None:
            self.router.mark_dead(instance_id, exc)

    def _stop_routing(self) -> None:
        self._stop.set()
        if self.router is not None:
            self.router.close()

    # -- the controller's operations -------------------------------------------------------------
    def start(self) -> Cluster:
        self.controller.start()
        return self

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self, stop_instances: bool = True, adopted_too: bool = True) -> None:
        self.controller.shutdown(stop_instances, adopted_too)

    @property
    def autoscaler(self):
        """The controller's autoscaler (cluster/autoscale/autoscale_loop.py), when the spec asks for one."""
        return self.controller.autoscaler

    @autoscaler.setter
    def autoscaler(self, value) -> None:
        self.controller.autoscaler = value

    def add_instance(self, role: str) -> str:
        return self.controller.add_instance(role)

    def remove_instance(self, instance_id: str, dead: bool = False) -> None:
        self.controller.remove_instance(instance_id, dead)

    def drain_instance(self, instance_id: str, timeout_s: float = 120.0) -> bool:
        return self.controller.drain_instance(instance_id, timeout_s)

    def flip_instance(self, instance_id: str, role: str, timeout_s: float = 120.0) -> dict[str, float]:
        """Changes an instance's role in place (cluster/control/flip.py): the seconds it took."""
        return self.controller.flip_instance(instance_id, role, timeout_s)

    def kill_instance(self, instance_id: str) -> None:
        self.controller.kill_instance(instance_id)

    def assert_no_leaks(self, timeout_s: float = 15.0) -> None:
        self.controller.assert_no_leaks(timeout_s)
