"""A gateway's cluster as its readers see it (cluster/control/serving.py, router/view.py): copies of
each instance's info with a typed load, /status rows with expert counts asked of each instance at
most once per ExpertCountCache.ttl_s however often /status is read (it used to be one Ray call per
instance per read), and the routers' counters."""
from __future__ import annotations

from cluster.control.expert_counts import ExpertCountCache
from cluster.control.instance import Instance
from cluster.control.serving import Serving
from cluster.ranks.nodes import RankPlacement
from cluster.spec import ClusterSpec
from cluster.state import MemoryState
from kvtransfer.params import KVEndpoint
from router.client import InstanceDeadError, InstanceInfo, InstanceLoad


class CountingClient:
    def __init__(self, info: InstanceInfo, dead: bool = False):
        self.info, self.calls, self.dead = info, 0, dead

    def expert_counts(self):
        self.calls += 1
        if self.dead:
            raise InstanceDeadError(self.info.instance_id, "gone")
        return {3: [1, 2]}


def instance(iid: str, role: str = "decode", dead: bool = False) -> Instance:
    endpoints = (KVEndpoint(iid, 0, "10.0.0.2", 7000),) if role == "decode" else ()
    info = InstanceInfo(iid, role, 1, endpoints, load=InstanceLoad.of({"running": 2.0, "decode_steps": 9.0}))
    return Instance(iid, role, 1, [], CountingClient(info, dead), placements=[RankPlacement(0, "10.0.0.2", 42)])


def test_infos_are_copies_with_a_typed_load():
    serving = Serving(ClusterSpec(), {"d": instance("d")}, MemoryState())
    (info,) = serving.instance_infos()
    assert info.load.running == 2.0 and info.load.figures["decode_steps"] == 9.0 and info.load.waiting == 0.0
    info.healthy = False
    assert serving.instances["d"].client.info.healthy  # the owner's own is untouched


def test_status_rows_ask_expert_counts_once_per_ttl_and_a_dead_instance_shows_none():
    serving = Serving(ClusterSpec(), {"d": instance("d"), "x": instance("x", dead=True)}, MemoryState())
    for _ in range(20):
        rows = serving.instance_status()
    assert [r["expert_counts"] for r in rows] == [{"3": [1, 2]}, None]
    assert rows[0]["load"] == {"running": 2.0, "decode_steps": 9.0} and rows[0]["kv_endpoints"] == [["10.0.0.2", 7000]]
    assert rows[0]["ranks"][0]["node_ip"] == "10.0.0.2"
    assert [i.client.calls for i in serving.instances.values()] == [1, 1]


def test_the_cache_asks_again_after_its_ttl_and_forgets_instances_gone():
    a, b = instance("a"), instance("b")
    cache = ExpertCountCache(ttl_s=0.0)
    cache.get([a, b])
    cache.get([a])
    assert (a.client.calls, b.client.calls) == (2, 1) and set(cache._seen) == {"a"}


def test_router_stats_are_the_published_ones_without_a_router():
    state = MemoryState()
    state.publish_router("router-x", {"submitted": 3.0}, 30.0)
    assert Serving(ClusterSpec(), {}, state).router_stats() == {"router-x": {"submitted": 3.0}}
