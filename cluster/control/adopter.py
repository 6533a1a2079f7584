"""How a controller finds the instances an earlier controller left running (cluster/control/controller.py
explains when): the named rank actors of its Ray namespace, each instance adopted only when
complete, ready and of the spec it runs; everything else is stopped."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace

from typing import Callable

from cluster.control.instance import Instance
from cluster.control.rank_planner import RankPlanner
from cluster.ranks import nodes
from cluster.spec import ClusterSpec
from cluster.state import ClusterState
from router.client import InstanceInfo

logger = logging.getLogger(__name__)
_RANK_NAME = re.compile(r"(?P<iid>.+)\.rank(?P<rank>\d+)")


@dataclass
class Adopted:
    """What `Adopter.adopt` found: the instances taken over (`unregistered`: those of them the
    cluster state does not list as alive), and every instance id seen (new ids continue after them)."""
    instances: dict[str, Instance] = field(default_factory=dict)
    unregistered: list[Instance] = field(default_factory=list)
    seen_ids: list[str] = field(default_factory=list)


class Adopter:
    """Finds the instances of one Ray namespace: what it needs of the controller is passed in (the
    spec, cluster state, rank planner, node placements and a way to make an instance's client)."""

    def __init__(self, spec: ClusterSpec, state: ClusterState, namespace: str, planner: RankPlanner,
                 placements: nodes.PlacementManager, make_client: Callable[[InstanceInfo, object], object]):
        self.spec, self.state, self.namespace, self.planner = spec, state, namespace, planner
        self.placements, self.make_client = placements, make_client

    def adopt(self) -> Adopted:
        """Takes over the complete, ready instances found in this cluster's Ray namespace; kills
        the ranks of incomplete ones (a controller died while starting them) and forgets the
        records of instances that are gone."""
        import ray
        adopted = Adopted()
        ranks: dict[str, dict[int, str]] = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            m = _RANK_NAME.fullmatch(entry["name"]) if entry["namespace"] == self.namespace else None
            if m:
                ranks.setdefault(m["iid"], {})[int(m["rank"])] = entry["name"]
        records = {r.instance_id: r for r in self.state.list_instances()}
        adopted.seen_ids = sorted({*ranks, *records})
        for iid in sorted(ranks):
            try:
                inst = self._adopt_one(iid, ranks[iid])
            except Exception as exc:  # noqa: BLE001 - any failure: the instance is not usable
                logger.warning("not adopting %s (%s): stopping its ranks", iid, exc)
                self._kill_named(ranks[iid].values())
                self._remove_pg(iid)
                continue
            adopted.instances[iid] = inst
            if records.get(iid) is None or records[iid].health == "dead":
                adopted.unregistered.append(inst)
        for iid in records:
            if iid not in adopted.instances:
                self.state.remove(iid)
        self._remove_orphan_pgs(adopted.instances)
        return adopted

    def _adopt_one(self, iid: str, named: dict[int, str]) -> Instance:
        import ray
        actors = [ray.get_actor(named[r], namespace=self.namespace) for r in sorted(named)]
        described = ray.get([a.describe.remote() for a in actors], timeout=2 * self.spec.heartbeat_ttl_s + 10)
        head = described[0]
        if sorted(named) != list(range(head["tp_size"])) or not all(d["ready"] for d in described):
            ready = [d["ready"] for d in described]
            raise RuntimeError(f"ranks {sorted(named)} of tp={head['tp_size']}, ready {ready}")
        role, tp = head["role"], head["tp_size"]
        if role not in self.spec.instance_counts or tp != self.spec.tp_size(role) or \
                not self.same_engine(head["config"], role):
            raise RuntimeError(f"it runs another spec ({role}, tp={tp}, {head['config']})")
        placements = [d["placement"] for d in described]
        by_ip = {n.address: n for n in nodes.alive_nodes()}
        node = by_ip[placements[0].node_ip] if placements[0].node_ip in by_ip else None
        pg = ray.util.get_placement_group(f"{self.namespace}/{iid}")
        if node is not None:
            self.placements.adopt(iid, role, tp, self.planner.rank_resources(role, self.planner.use_gpus()),
                                  node.node_id)
            slots = self.planner.core_slots
            if slots is not None and all(d.get("cpu_slot") is not None for d in described):
                with self.planner.cores_lock:
                    slots.hold(node.node_id, iid, [d["cpu_slot"] for d in described])
        endpoints = tuple(d["kv_endpoint"] for d in described) if role == "decode" else ()
        info = InstanceInfo(iid, role, tp, endpoints, max_model_len=head["max_model_len"],
                            block_size=head.get("block_size", 0), engine=head.get("engine", {}))
        inst = Instance(iid, role, tp, actors, self.make_client(info, actors[0]), pg, placements=placements,
                        node_id=None if node is None else node.node_id)
        logger.info("adopted %s (%s, tp=%d) on %s", iid, role, tp, placements[0].node_ip)
        return inst

    def same_engine(self, config, role: str) -> bool:
        """`config` is what this spec runs for `role` (threads aside when the spec leaves them to us;
        on GPU with the GPU plan's gpu_memory_utilization, as the controller starts it)."""
        want = self.planner.role_engine_config(role, self.planner.use_gpus())
        if want.num_threads is None:
            config = replace(config, num_threads=None, adapt_threads=False)
        return config == want

    def _kill_named(self, names) -> None:
        import ray
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:  # gone meanwhile
                pass

    def _remove_pg(self, iid: str) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(ray.util.get_placement_group(f"{self.namespace}/{iid}"))
        except ValueError:
            pass

    def _remove_orphan_pgs(self, adopted: dict[str, Instance]) -> None:
        """Named groups of this namespace that no adopted instance holds (a controller died
        between reserving one and starting its ranks)."""
        from ray.util.placement_group import placement_group_table
        prefix = f"{self.namespace}/"
        for entry in placement_group_table().values():
            name = entry.get("name") or ""
            if name.startswith(prefix) and entry.get("state") != "REMOVED" and name[len(prefix):] not in adopted:
                logger.info("removing placement group %s (no instance holds it)", name)
                self._remove_pg(name[len(prefix):])
