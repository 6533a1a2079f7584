"""What a reader of the cluster gets: gateways (their /status and /metrics), the autoscaler and the
controller's HTTP app read typed snapshots through this protocol, never the owner's live objects
(HOUSE_STYLE 30). cluster/control/ implements it twice: `Serving` (a gateway's cluster, in
serving.py) and `Controller` (controller.py)."""
from __future__ import annotations

from typing import Protocol

from router.client import InstanceInfo


class ClusterView(Protocol):
    def instance_infos(self) -> list[InstanceInfo]:
        """A copy of each instance's info as its owner knows it now (role, health, draining, typed
        load, engine, KV endpoints)."""

    def instance_status(self) -> list[dict]:
        """One JSON-ready row per instance, as /status shows it (its info and its ranks' placements)."""

    def router_stats(self) -> dict[str, dict[str, float]]:
        """Every live router's request counters (and queue length), by router id."""
