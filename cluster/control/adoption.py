"""How a controller finds the instances an earlier controller left running (cluster/control/controller.py
explains when): the named rank actors of its Ray namespace, each instance adopted only when
complete, ready and of the spec it runs; everything else is stopped."""
from __future__ import annotations

import logging
import re
from dataclasses import replace

from cluster.control.instance import Instance
from cluster.ranks import nodes
from cluster.state import InstanceRecord
from router.client import InstanceInfo

logger = logging.getLogger(__name__)
_RANK_NAME = re.compile(r"(?P<iid>.+)\.rank(?P<rank>\d+)")


class Adoption:
    """Controller's adoption methods (a mixin: it uses the controller's spec, state, namespace,
    placement manager and instance table)."""

    def _adopt(self) -> None:
        """Takes over the complete, ready instances found in this cluster's Ray namespace; kills
        the ranks of incomplete ones (a controller died while starting them) and forgets the
        records of instances that are gone. New ids continue after every id seen."""
        import ray
        ranks: dict[str, dict[int, str]] = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            m = _RANK_NAME.fullmatch(entry["name"]) if entry["namespace"] == self._namespace else None
            if m:
                ranks.setdefault(m["iid"], {})[int(m["rank"])] = entry["name"]
        records = {r.instance_id: r for r in self.state.list_instances()}
        for iid in sorted(ranks):
            self._note_id(iid)
            try:
                self._adopt_one(iid, ranks[iid], records.get(iid))
            except Exception as exc:  # noqa: BLE001 - any failure: the instance is not usable
                logger.warning("not adopting %s (%s): stopping its ranks", iid, exc)
                self._kill_named(ranks[iid].values())
                self._remove_pg(iid)
        for iid, record in records.items():
            self._note_id(iid)
            if iid not in self.instances:
                self.state.remove(iid)
        self._remove_orphan_pgs()

    def _adopt_one(self, iid: str, named: dict[int, str], record: InstanceRecord | None) -> None:
        import ray
        actors = [ray.get_actor(named[r], namespace=self._namespace) for r in sorted(named)]
        described = ray.get([a.describe.remote() for a in actors], timeout=2 * self.spec.heartbeat_ttl_s + 10)
        head = described[0]
        if sorted(named) != list(range(head["tp_size"])) or not all(d["ready"] for d in described):
            ready = [d["ready"] for d in described]
            raise RuntimeError(f"ranks {sorted(named)} of tp={head['tp_size']}, ready {ready}")
        role, tp = head["role"], head["tp_size"]
        if role not in self.spec.instance_counts or tp != self.spec.tp_size(role) or \
                not self._same_engine(head["config"], role):
            raise RuntimeError(f"it runs another spec ({role}, tp={tp}, {head['config']})")
        placements = [d["placement"] for d in described]
        by_ip = {n.address: n for n in nodes.alive_nodes()}
        node = by_ip[placements[0].node_ip] if placements[0].node_ip in by_ip else None
        pg = ray.util.get_placement_group(f"{self._namespace}/{iid}")
        if node is not None:
            self._nodes.adopt(iid, role, tp, self._rank_resources(role, self._use_gpus()), node.node_id)
            if self._core_slots is not None and all(d.get("cpu_slot") is not None for d in described):
                self._core_slots.hold(node.node_id, iid, [d["cpu_slot"] for d in described])
        endpoints = tuple(d["kv_endpoint"] for d in described) if role == "decode" else ()
        info = InstanceInfo(iid, role, tp, endpoints, max_model_len=head["max_model_len"],
                            block_size=head.get("block_size", 0), engine=head.get("engine", {}))
        inst = Instance(iid, role, tp, actors, self._ray_client(info, actors[0]), pg, placements=placements,
                        node_id=None if node is None else node.node_id)
        self.instances[iid] = inst
        self.adopted.append(iid)
        if record is None or record.health == "dead":
            self._register(inst)
        logger.info("adopted %s (%s, tp=%d) on %s", iid, role, tp, placements[0].node_ip)

    def _same_engine(self, config, role: str) -> bool:
        """`config` is what this spec runs for `role` (threads aside when the spec leaves them to us;
        on GPU with the GPU plan's gpu_memory_utilization, as the controller starts it)."""
        want = self._role_engine_config(role, self._use_gpus())
        if want.num_threads is None:
            config = replace(config, num_threads=None, adapt_threads=False)
        return config == want

    def _kill_named(self, names) -> None:
        import ray
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=self._namespace), no_restart=True)
            except ValueError:  # gone meanwhile
                pass

    def _remove_pg(self, iid: str) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(ray.util.get_placement_group(f"{self._namespace}/{iid}"))
        except ValueError:
            pass

    def _remove_orphan_pgs(self) -> None:
        """Named groups of this namespace that no adopted instance holds (a controller died
        between reserving one and starting its ranks)."""
        from ray.util.placement_group import placement_group_table
        prefix = f"{self._namespace}/"
        for entry in placement_group_table().values():
            name = entry.get("name") or ""
            if name.startswith(prefix) and entry.get("state") != "REMOVED" and name[len(prefix):] not in self.instances:
                logger.info("removing placement group %s (no instance holds it)", name)
                self._remove_pg(name[len(prefix):])
