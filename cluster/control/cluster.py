"""The cluster in one process: the controller (cluster/control/controller.py: the instances) and a router
over them, plus an offline `generate` API. `pdserve serve` and the tests use it.

    Cluster(spec).start()
      Controller.start: Ray, instances (adopted or started), start-up checks
      Router(prefill clients, decode clients, policy)  -> generate() / submit() go through it
      its counters -> cluster state (the autoscaler reads every router's, this one's included)

Other gateways (cluster/control/frontend.py) may route over the same instances through the cluster state.
With `use_ray=False` the instances run in this process (tp=1 only): quick tests and tools.
"""
from __future__ import annotations

import threading

from cluster.control.controller import Controller
from cluster.control.frontend import Serving, create_router, publish_stats
from cluster.control.instance import Instance, setup_ray_auth  # noqa: F401 (re-exported)
from router.router import Router


class Cluster(Controller, Serving):
    router: Router | None = None

    # -- the router follows the controller's membership ------------------------------------------
    def _on_started(self) -> None:
        by_role = lambda *roles: [i.client for i in self.instances.values() if i.role in roles]  # noqa: E731
        self.router = create_router(self.spec, self.state, by_role("prefill"), by_role("decode", "colocated"))
        self.router.start()
        ttl = 3 * self.spec.heartbeat_ttl_s
        threading.Thread(target=publish_stats, args=(self.router, self.state, self._stop, ttl),
                         daemon=True, name="cluster-stats").start()

    def _on_added(self, inst: Instance) -> None:
        self.router.add_instance(inst.client)

    def _on_draining(self, instance_id: str) -> None:
        self.router.drain(instance_id)

    def _on_removed(self, instance_id: str) -> None:
        if self.router is not None:
            self.router.remove_instance(instance_id)

    def _on_lost(self, instance_id: str, exc: Exception) -> None:
        self.router.mark_dead(instance_id, exc)

    def _on_shutdown(self) -> None:
        if self.router is not None:
            self.router.close()

    def _is_drained(self, inst: Instance) -> bool:
        return self.router.is_drained(inst.instance_id) and super()._is_drained(inst)

    def router_stats(self) -> dict[str, dict[str, float]]:
        """As published, with this process' router's counters as they are now."""
        return {**super().router_stats(), self.router.client_id: self.router.snapshot()}
