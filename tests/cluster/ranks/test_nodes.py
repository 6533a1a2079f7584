"""Node choice, per-node addresses and the start-up network checks of cluster/ranks/nodes.py: pure
functions over node dicts, plus the rank actor's `placement` and `probe` on a local Ray."""
from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch

from cluster.ranks import nodes
from cluster.ranks.nodes import NodeInfo, PlacedInstance, PlacementError, RankPlacement
from kvtransfer.params import KVEndpoint
from kvtransfer.registry import create_kv_transport
from tests.kvtransfer.test_torch_dist import COMPAT, HEADS, TRAILER, make_cache, make_receiver, poll_until, send_part

pytestmark = pytest.mark.timeout(120)


def create_node(address: str, cpus: float = 8, gpus: float = 0, **custom: float) -> NodeInfo:
    """A node as parse_nodes makes it, with Ray's per-node resource."""
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), f"node:{address}": 1.0, **custom}
    return NodeInfo(f"id-{address}", address, res)


def placed_on(node: NodeInfo, role: str, tp: int = 1, **per_rank: float) -> PlacedInstance:
    return PlacedInstance(node.node_id, role, {k: v * tp for k, v in {"CPU": 1.0, **per_rank}.items()})


def place_many(candidates: list[NodeInfo], roles: list[str], per_rank: dict, tp: int = 1) -> list[str]:
    """Places instances one after another, as Cluster does; returns each one's node address."""
    placed, where = [], []
    for role in roles:
        node = nodes.choose_node(candidates, role, tp, per_rank, placed)
        placed.append(PlacedInstance(node.node_id, role, {k: v * tp for k, v in per_rank.items()}))
        where.append(node.address)
    return where


def test_parse_nodes_keeps_alive_ones_in_address_order():
    """Dead nodes are left out; addresses and total resources come from ray.nodes() fields."""
    raw = [{"NodeID": "b", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0}},
           {"NodeID": "x", "Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 4.0}},
           {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {}}]
    assert nodes.parse_nodes(raw) == [NodeInfo("a", "10.0.0.1", {}), NodeInfo("b", "10.0.0.2", {"CPU": 4.0})]


def test_instances_of_a_role_spread_over_nodes():
    """Each new instance goes to the node with the fewest of its role; prefill and decode of the
    first pair land on different nodes (fewest of any role breaks the tie)."""
    a, b, c = create_node("10.0.0.1"), create_node("10.0.0.2"), create_node("10.0.0.3")
    where = place_many([a, b, c], ["prefill", "decode", "decode", "decode", "prefill"], {"CPU": 1.0})
    assert where == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1", "10.0.0.2"]


def test_suspect_nodes_are_used_last():
    """A node where an instance just died (Ray may still call a cut-off node alive) gets a new
    instance only when no other node has room for it."""
    a, b = create_node("10.0.0.1", cpus=2), create_node("10.0.0.2", cpus=2)
    busy_b = [placed_on(b, "decode")]
    assert nodes.choose_node([a, b], "decode", 1, {"CPU": 1.0}, [placed_on(a, "decode")] * 2,
                             suspect=[b.node_id]) == b  # a is full
    assert nodes.choose_node([a, b], "decode", 1, {"CPU": 1.0}, busy_b, suspect=[a.node_id]) == b
    assert nodes.choose_node([a, b], "decode", 1, {"CPU": 1.0}, busy_b) == a


def test_full_and_small_nodes_are_skipped():
    """A node without room for every rank of the TP group is skipped, even if it has fewer instances."""
    small, big = create_node("10.0.0.1", cpus=1), create_node("10.0.0.2", cpus=4)
    assert place_many([small, big], ["decode", "decode"], {"CPU": 1.0}, tp=2) == ["10.0.0.2", "10.0.0.2"]
    with pytest.raises(PlacementError):
        place_many([small, big], ["decode"] * 3, {"CPU": 1.0}, tp=2)
    busy = create_node("10.0.0.3", cpus=2)
    got = nodes.choose_node([busy, big], "prefill", 2, {"CPU": 1.0}, [placed_on(busy, "decode", tp=1)])
    assert got is big  # busy has 1 of 2 CPUs left


def test_role_resources_and_gpus_restrict_nodes():
    """With ray_resources, only nodes carrying the role's resource qualify; on GPU, only nodes with GPUs."""
    p, d = create_node("10.0.0.1", prefill=4), create_node("10.0.0.2", decode=4)
    assert nodes.rank_resources("colocated", False, True) == {"CPU": 1.0, "decode": 1.0}
    per_rank = nodes.rank_resources("decode", False, True)
    assert place_many([p, d], ["decode", "decode"], per_rank) == ["10.0.0.2", "10.0.0.2"]
    assert place_many([p, d], ["prefill"], nodes.rank_resources("prefill", False, True)) == ["10.0.0.1"]
    cpu_only, gpu = create_node("10.0.0.3"), create_node("10.0.0.4", gpus=2)
    assert place_many([cpu_only, gpu], ["decode", "prefill"], nodes.rank_resources("decode", True, False)) == \
        ["10.0.0.4", "10.0.0.4"]


def test_shared_worker_pods_take_either_role():
    """With worker_pods shared, every role asks for `worker`: a node carrying it takes prefill and decode
    instances alike, and a per-role node takes neither."""
    p, shared = create_node("10.0.0.1", prefill=4), create_node("10.0.0.2", worker=2)
    per_rank = {role: nodes.rank_resources(role, False, True, shared=True) for role in ("prefill", "decode")}
    assert per_rank["prefill"] == per_rank["decode"] == {"CPU": 1.0, "worker": 1.0}
    assert place_many([p, shared], ["prefill", "decode"], per_rank["prefill"]) == ["10.0.0.2", "10.0.0.2"]
    with pytest.raises(PlacementError, match="worker"):
        place_many([p, shared], ["prefill"] * 3, per_rank["prefill"])


def test_shares_of_one_gpu_fit_on_a_one_gpu_node():
    """Ranks asking for shares of a GPU (cluster/control/gpu_share.py: 1P1D on one GPU) both fit on a
    node with one GPU; a third share that does not fit names the GPU left."""
    one_gpu = create_node("10.0.0.1", gpus=1)
    prefill = nodes.rank_resources("prefill", True, False, num_gpus=0.3333)
    decode = nodes.rank_resources("decode", True, False, num_gpus=0.6666)
    assert prefill == {"CPU": 1.0, "GPU": 0.3333}
    placed = [placed_on(one_gpu, "decode", GPU=0.6666)]
    assert nodes.choose_node([one_gpu], "prefill", 1, prefill, placed) is one_gpu
    with pytest.raises(PlacementError, match=r"0.3334 of 1 GPU free"):
        nodes.choose_node([one_gpu], "decode", 1, decode, placed)


def test_no_room_error_is_one_line_naming_role_tp_and_nodes():
    """The error names the role, the TP size, what it asks for and why each node was refused."""
    small, prefill_only = create_node("10.0.0.1", cpus=1, decode=1), create_node("10.0.0.2", cpus=8, prefill=2)
    with pytest.raises(PlacementError) as exc:
        nodes.choose_node([small, prefill_only], "decode", 2, nodes.rank_resources("decode", False, True),
                          [placed_on(prefill_only, "prefill", tp=8)])
    assert str(exc.value) == ("no Ray node has room for a decode instance (tp=2: 2 CPU, 2 decode); nodes considered: "
                              "10.0.0.1 (1 of 1 CPU free), 10.0.0.2 (no decode)")  # lacking before full
    with pytest.raises(PlacementError, match="none alive"):
        nodes.choose_node([], "prefill", 1, {"CPU": 1.0}, [])


def test_bundles_are_pinned_to_the_chosen_node():
    """Every bundle carries a sliver of Ray's `node:<address>` resource, so STRICT_PACK lands there."""
    bundles = nodes.pinned_bundles({"CPU": 1.0}, create_node("10.0.0.7"), 3)
    assert bundles == [{"CPU": 1.0, "node:10.0.0.7": nodes.PIN}] * 3


def test_duplicate_node_addresses_are_refused():
    """Two alive nodes advertising one address: ValueError naming both node ids and the address."""
    nodes.check_unique_addresses([NodeInfo("n1", "10.0.0.1", {}), NodeInfo("n2", "10.0.0.2", {})])
    with pytest.raises(ValueError, match="n1 and n2 both advertise 127.0.0.1"):
        nodes.check_unique_addresses([NodeInfo("n1", "127.0.0.1", {}), NodeInfo("n2", "127.0.0.1", {})])
    nodes.check_advertised([("n1", "10.0.0.1"), ("n1", "10.0.0.1"), ("n2", "10.0.0.2")])
    with pytest.raises(ValueError, match="n1 and n2 both advertise 10.0.0.1"):
        nodes.check_advertised([("n1", "10.0.0.1"), ("n2", "10.0.0.1")])


def test_node_address_override_and_loopback():
    """PDSERVE_NODE_IP wins on a joined cluster; a driver-started Ray always binds loopback."""
    assert nodes.node_address(False, {nodes.NODE_IP_ENV: "10.1.2.3"}) == "10.1.2.3"
    assert nodes.node_address(True, {nodes.NODE_IP_ENV: "10.1.2.3"}) == "127.0.0.1"


def test_interface_of_an_address():
    """127.0.0.1 is on lo; an address no interface holds gives None; fake tables work too."""
    assert nodes.interface_of("127.0.0.1") == "lo"
    assert nodes.interface_of("203.0.113.77") is None
    fake = {"lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1")],
            "veth1": [SimpleNamespace(family=socket.AF_PACKET, address="aa:bb:cc:dd:ee:ff"),
                      SimpleNamespace(family=socket.AF_INET6, address="fe80::1%veth1"),
                      SimpleNamespace(family=socket.AF_INET, address="10.214.0.3")]}
    assert nodes.interface_of("10.214.0.3", fake) == "veth1"
    assert nodes.interface_of("fe80::1", fake) == "veth1"


def test_socket_ifnames_set_unless_the_user_did():
    """GLOO_/NCCL_SOCKET_IFNAME get the interface of the address; a value the user set is kept."""
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert nodes.set_socket_ifnames("127.0.0.1", env) == "lo"
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}
    env = {}
    assert nodes.set_socket_ifnames("203.0.113.77", env) is None and env == {}


def test_probe_finds_closed_ports_and_leaves_a_kv_receiver_working():
    """A listening socket and a KV receiver's endpoint are reachable, a closed port is not; the
    receiver counts no garbage for the bare connects and still takes a transfer after them."""
    rx, _, dest = make_receiver()
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        eps = [listening.getsockname(), dest.address, closed.getsockname()]
        start = time.monotonic()
        assert nodes.unreachable(eps, 2.0) == [f"127.0.0.1:{closed.getsockname()[1]}"]
        assert time.monotonic() - start < 2.0
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    rx.expect("r", torch.arange(4), 1)
    send_part(tx, "r", dest, make_cache(), torch.arange(4), 0, HEADS).wait(10)
    assert poll_until(rx)[0] == [("r", TRAILER)] and rx.stats["garbage_messages"] == 0
    assert nodes.unreachable([], 1.0) == []
    tx.close(), rx.close()


def test_reachability_error_is_one_line():
    """Names the prefill node and each unreachable decode endpoint with its owner."""
    msg = nodes.reachability_error("10.0.0.1", ["10.0.0.2:4000"], {"10.0.0.2:4000": "decode-0 rank 0 on 10.0.0.2"})
    assert msg == "prefill node 10.0.0.1 cannot reach decode KV endpoint(s) 10.0.0.2:4000 (decode-0 rank 0 on 10.0.0.2)"


def fake_instance(iid: str, role: str, node_id: str, actor, placements, endpoints=()):
    """Just what check_network reads of a cluster Instance."""
    return SimpleNamespace(instance_id=iid, role=role, node_id=node_id, ranks=[actor], placements=placements,
                           kv_endpoints=tuple(endpoints))


def test_rank_actor_placement_and_network_check(ray_session):
    """A rank actor reports (rank, 127.0.0.1, its pid) on a driver-started Ray and probes from its
    node; check_network passes for a listening endpoint and names a closed one in one line."""
    import ray
    from cluster.ranks.actor import RankActor
    from engine.core.config import EngineConfig
    actor = RankActor.remote(EngineConfig(model="unused"), "prefill", "prefill-0", 0, 1, 5.0, "WARNING", True)
    where = ray.get(actor.placement.remote(), timeout=60)
    assert where == RankPlacement(0, "127.0.0.1", ray.get(actor.pid.remote()))
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))
        ok, bad = listening.getsockname()[1], closed.getsockname()[1]
        prefill = fake_instance("prefill-0", "prefill", "n1", actor, [where])
        good = fake_instance("decode-0", "decode", "n2", None, [RankPlacement(0, "127.0.0.3", 1)],
                             [KVEndpoint("decode-0", 0, "127.0.0.1", ok)])
        nodes.check_network([prefill, good], timeout_s=2.0)
        broken = fake_instance("decode-1", "decode", "n3", None, [RankPlacement(0, "127.0.0.2", 1)],
                               [KVEndpoint("decode-1", 0, "127.0.0.1", bad)])
        with pytest.raises(ValueError, match=f"prefill node 127.0.0.1 cannot reach .*127.0.0.1:{bad} "
                                             f"\\(decode-1 rank 0 on node 127.0.0.2\\)") as exc:
            nodes.check_network([prefill, good, broken], new=broken, timeout_s=2.0)
        assert "\n" not in str(exc.value) and f":{ok}" not in str(exc.value)  # only the new one's pairs
    ray.kill(actor)
