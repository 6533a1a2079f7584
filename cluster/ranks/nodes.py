"""Where ranks run on a multi-host Ray cluster: the nodes, the choice of a node per instance,
each rank's own address and network interface, and the start-up network checks.

    alive_nodes()          ray.nodes() -> [NodeInfo(node_id, address, resources)]
    choose_node(...)       the eligible node with the fewest instances of the role that has room
    pinned_bundles(...)    one STRICT_PACK bundle per rank, pinned with `node:<address>: 0.001`
    PlacementManager       both of those for a Cluster, plus what its instances hold per node
    node_address(...)      in the rank's actor: PDSERVE_NODE_IP, else Ray's address of this node
    set_socket_ifnames()   GLOO_/NCCL_SOCKET_IFNAME = the interface that holds that address
    unreachable(...)       the (host, port) endpoints a plain TCP connect cannot reach
    check_network(...)     start-up check: each decode KV endpoint reachable from each prefill node

All but the Ray calls (alive_nodes, node_address, create_placement_group, PlacementManager,
check_network) are pure functions over plain values, tested without Ray. Decisions: docs/multihost.md.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

NODE_IP_ENV = "PDSERVE_NODE_IP"  # set on a node (the raylet's environment): the address its ranks bind
LOOPBACK = "127.0.0.1"
PIN = 0.001  # of Ray's built-in `node:<address>` resource (1.0 per node), per bundle


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of an instance runs: the address it binds (its node's), its process, and how
    that process shares the host's CPUs (cluster/ranks/cpu_plan.py cpu_state; {} until the rank is set up)."""
    rank: int
    node_ip: str
    pid: int
    cpu: dict = field(default_factory=dict)

    def status(self) -> dict:
        """This rank as /status shows it."""
        return {"rank": self.rank, "node_ip": self.node_ip, "pid": self.pid, "cpu": self.cpu}


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node: its id, the address Ray knows it by, and its total resources."""
    node_id: str
    address: str
    resources: Mapping[str, float]


class PlacementError(ValueError):
    """No node can take an instance (the message names the role, TP size and nodes considered).
    A ValueError: the spec asks for more than the Ray cluster has (`pdserve` prints one line)."""


def parse_nodes(raw: Iterable[Mapping]) -> list[NodeInfo]:
    """The alive nodes of a `ray.nodes()` answer, in address order."""
    nodes = [NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
             for n in raw if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n.address, n.node_id))


def alive_nodes() -> list[NodeInfo]:
    """The alive nodes of the Ray cluster this process is connected to."""
    import ray
    return parse_nodes(ray.nodes())


def check_unique_addresses(nodes: Iterable[NodeInfo]) -> None:
    """Raises ValueError when two alive nodes advertise one address (e.g. both 127.0.0.1 from
    different machines): ranks there would be told to reach each other at the wrong place."""
    seen: dict[str, str] = {}
    for n in nodes:
        if n.address in seen:
            raise ValueError(f"Ray nodes {seen[n.address]} and {n.node_id} both advertise {n.address}: "
                             f"start each node with its own --node-ip-address (or set {NODE_IP_ENV})")
        seen[n.address] = n.node_id


def role_resource(role: str, shared: bool = False) -> str:
    """The custom Ray resource that marks nodes for a role (colocated instances use decode's); with
    `shared` worker pods (spec worker_pods), `worker` for every role: an instance may flip in place."""
    if shared:
        return "worker"
    return "prefill" if role == "prefill" else "decode"


def rank_resources(role: str, gpu: bool, ray_resources: bool, num_gpus: float = 1.0,
                   shared: bool = False) -> dict[str, float]:
    """What one rank's bundle asks of its node: a CPU, and on GPU `num_gpus` (a GPU, or a rank's
    share of one when ranks share GPUs: cluster/control/gpu_share.py)."""
    need = {"CPU": 1.0, "GPU": num_gpus} if gpu else {"CPU": 1.0}
    if ray_resources:  # Kubernetes: only worker pods of this role (or shared ones) carry the resource
        need[role_resource(role, shared)] = 1.0
    return need


def _shortfall(node: NodeInfo, need: Mapping[str, float], used: Mapping[str, float]) -> str | None:
    """Why `node` cannot take `need` on top of `used` (a resource it lacks before one that is
    taken); None when it fits."""
    if missing := [k for k in need if node.resources.get(k, 0.0) <= 0]:
        return f"no {', '.join(missing)}"
    for key, amount in need.items():
        free = node.resources[key] - used.get(key, 0.0)
        if free < amount - 1e-9:
            return f"{free:g} of {node.resources[key]:g} {key} free"
    return None


@dataclass(frozen=True)
class PlacedInstance:
    """What one instance of this cluster holds on a node: all its bundles together."""
    node_id: str
    role: str
    resources: Mapping[str, float]


def choose_node(nodes: Iterable[NodeInfo], role: str, tp_size: int, per_rank: Mapping[str, float],
                placed: Iterable[PlacedInstance] = (), suspect: Iterable[str] = ()) -> NodeInfo:
    """The node for a new instance of `role` with `tp_size` ranks of `per_rank` each.

    Eligible: nodes that carry every resource a rank asks for (CPU, GPU, the role's) and still have
    room for all ranks after what this cluster's instances (`placed`) took there. Among them: nodes
    not in `suspect` (ids of nodes where an instance just died: Ray may still call a cut-off node
    alive for a minute), then the fewest instances of `role`, then the fewest of any role, then
    the lowest address.
    Raises PlacementError (one line naming the role, the TP size and each node considered)."""
    need = {k: v * tp_size for k, v in per_rank.items()}
    used: dict[str, dict[str, float]] = {}
    of_role, of_any = Counter(), Counter()
    for p in placed:
        taken = used.setdefault(p.node_id, {})
        for k, v in p.resources.items():
            taken[k] = taken.get(k, 0.0) + v
        of_any[p.node_id] += 1
        of_role[p.node_id] += p.role == role
    fits, why = [], []
    for n in nodes:
        reason = _shortfall(n, need, used.get(n.node_id, {}))
        if reason is None:
            fits.append(n)
        else:
            why.append(f"{n.address} ({reason})")
    if not fits:
        asks = ", ".join(f"{v:g} {k}" for k, v in need.items())
        raise PlacementError(f"no Ray node has room for a {role} instance (tp={tp_size}: {asks}); "
                             f"nodes considered: {', '.join(why) or 'none alive'}")
    suspect = set(suspect)
    return min(fits, key=lambda n: (n.node_id in suspect, of_role[n.node_id], of_any[n.node_id], n.address))


def pinned_bundles(per_rank: Mapping[str, float], node: NodeInfo, tp_size: int) -> list[dict[str, float]]:
    """One bundle per rank, each pinned to `node` through Ray's per-node resource."""
    return [{**per_rank, f"node:{node.address}": PIN} for _ in range(tp_size)]


def node_address(loopback: bool, env: Mapping[str, str] = os.environ) -> str:
    """The address this process's ranks bind and advertise: 127.0.0.1 on a single-host (driver
    started) Ray; otherwise $PDSERVE_NODE_IP when the node sets it, else Ray's address of this node
    (its --node-ip-address). Call it inside the actor, never in the driver."""
    if loopback:
        return LOOPBACK
    if env.get(NODE_IP_ENV):
        return env[NODE_IP_ENV].strip()
    import ray
    return ray.util.get_node_ip_address()


def interface_of(address: str, if_addrs: Mapping[str, list] | None = None) -> str | None:
    """The network interface that holds `address` (`if_addrs`: psutil.net_if_addrs() form), or None."""
    try:
        want = ipaddress.ip_address(address)
    except ValueError:  # not an IP address (a host name in PDSERVE_NODE_IP)
        return None
    if if_addrs is None:
        import psutil
        if_addrs = psutil.net_if_addrs()
    for name, addrs in if_addrs.items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and _same_ip(a.address, want):
                return name
    return None


def _same_ip(text: str, want: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(text.split("%")[0]) == want  # fe80::1%eth0
    except ValueError:
        return False


def set_socket_ifnames(address: str, env: dict = os.environ, if_addrs: Mapping[str, list] | None = None) -> str | None:
    """Points gloo and NCCL at the interface that holds `address` (unless the user set
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). Call before any process group exists: without it gloo
    resolves the hostname, which in a network namespace can be 127.0.0.1, and picks `lo`.
    Returns the interface, or None when no interface holds the address."""
    name = interface_of(address, if_addrs)
    if name is None:
        logger.warning("no network interface holds %s: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME left as they are",
                       address)
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if env.get(var):
            logger.info("%s=%s kept (set by the user); %s is on %s", var, env[var], address, name)
        else:
            env[var] = name
            logger.info("%s=%s (the interface of %s)", var, name, address)
    return name


def unreachable(endpoints: Iterable[tuple[str, int]], timeout_s: float = 3.0) -> list[str]:
    """The endpoints ("host:port") a plain TCP connect from here cannot reach within `timeout_s`;
    all are tried at once. A bare connect and close leaves a torch TCPStore server undisturbed."""
    endpoints = list(endpoints)
    if not endpoints:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        ok = list(pool.map(lambda ep: _connects(ep, timeout_s), endpoints))
    return [f"{h}:{p}" for (h, p), good in zip(endpoints, ok) if not good]


def _connects(endpoint: tuple[str, int], timeout_s: float) -> bool:
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
        return True
    except OSError:
        return False


def reachability_error(prober: str, missing: Iterable[str], owners: Mapping[str, str]) -> str:
    """One line: the prefill node `prober` cannot reach the decode endpoints `missing`
    (`owners`: endpoint -> "decode-1 rank 0 on 10.0.0.3")."""
    what = ", ".join(f"{ep} ({owners.get(ep, '?')})" for ep in missing)
    return f"prefill node {prober} cannot reach decode KV endpoint(s) {what}"


def create_placement_group(bundles: list[dict[str, float]], node: NodeInfo, role: str, timeout_s: float = 120.0,
                           name: str = ""):
    """A STRICT_PACK placement group of `bundles` (pinned to `node`), ready; removed again and
    PlacementError raised when Ray cannot place it within `timeout_s` (resources taken by others).
    A `name`d group is detached (it outlives this process; a later controller finds it by name)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name, lifetime="detached" if name else None)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(f"a {role} instance (tp={len(bundles)}) was not placed on node {node.address} "
                             f"within {timeout_s:.0f} s: its resources are held by something else") from None
    return pg


class PlacementManager:
    """This cluster's instances per node: picks the node of a new instance (choose_node over the
    alive nodes and what this cluster already holds) and reserves its placement group there."""

    def __init__(self, pg_timeout_s: float = 120.0, suspect_s: float = 120.0):
        self.pg_timeout_s, self.suspect_s = pg_timeout_s, suspect_s
        self._lock = threading.Lock()  # concurrent additions see each other's reservations
        self._placed: dict[str, PlacedInstance] = {}  # instance id -> what it holds on its node
        self._suspect: dict[str, float] = {}  # node id -> until when (monotonic) it is used last

    def suspect(self, node_id: str | None) -> None:
        """An instance on `node_id` died: for `suspect_s`, new instances go elsewhere if they can."""
        if node_id is not None:
            with self._lock:
                self._suspect[node_id] = time.monotonic() + self.suspect_s

    def place(self, instance_id: str, role: str, tp_size: int, per_rank: Mapping[str, float], pg_name: str = ""):
        """Returns (node, ready placement group) for a new instance; raises PlacementError.
        `pg_name`: see create_placement_group."""
        with self._lock:
            now = time.monotonic()
            suspect = [n for n, until in self._suspect.items() if until > now]
            node = choose_node(alive_nodes(), role, tp_size, per_rank, self._placed.values(), suspect)
            held = {k: v * tp_size for k, v in per_rank.items()}
            self._placed[instance_id] = PlacedInstance(node.node_id, role, held)
        try:
            bundles = pinned_bundles(per_rank, node, tp_size)
            return node, create_placement_group(bundles, node, role, self.pg_timeout_s, pg_name)
        except BaseException:
            self._placed.pop(instance_id, None)
            raise

    def adopt(self, instance_id: str, role: str, tp_size: int, per_rank: Mapping[str, float], node_id: str) -> None:
        """An instance started by an earlier controller holds its share of `node_id`."""
        with self._lock:
            self._placed[instance_id] = PlacedInstance(node_id, role, {k: v * tp_size for k, v in per_rank.items()})

    def release(self, instance_id: str, pg) -> None:
        """The instance is gone: its placement group is removed and its node has room again."""
        from ray.util.placement_group import remove_placement_group
        self._placed.pop(instance_id, None)
        if pg is not None:
            remove_placement_group(pg)


def check_network(instances: list, new=None, timeout_s: float = 3.0) -> None:
    """Joined Ray: no two nodes' ranks advertise one address, and every decode rank's KV endpoint
    accepts a TCP connection from every node that runs a prefill instance (only the pairs that
    involve `new` when given: cheap enough for each added instance). `instances`: the cluster's
    Instance records (role, node_id, placements, ranks, kv_endpoints). Raises ValueError, one line
    naming the prefill node and the decode endpoints it cannot reach."""
    import ray
    check_advertised((i.node_id, p.node_ip) for i in instances for p in i.placements)
    prefill = [i for i in instances if i.role == "prefill" and (new is None or new.role != "prefill" or i is new)]
    decode = [i for i in instances if i.role == "decode" and (new is None or new.role != "decode" or i is new)]
    probers = list({i.node_id: i for i in prefill}.values())  # one prefill instance per node
    owners = {f"{e.host}:{e.port}": f"{i.instance_id} rank {e.rank} on node {i.placements[e.rank].node_ip}"
              for i in decode for e in i.kv_endpoints}
    endpoints = [(e.host, e.port) for i in decode for e in i.kv_endpoints]
    if not probers or not endpoints:
        return
    answers = ray.get([i.ranks[0].probe.remote(endpoints, timeout_s) for i in probers], timeout=60)
    problems = [reachability_error(i.placements[0].node_ip, missing, owners)
                for i, missing in zip(probers, answers) if missing]
    if problems:
        raise ValueError("; ".join(problems) + " (check firewalls and each node's address: docs/multihost.md)")


def check_advertised(placements: Iterable[tuple[str, str]]) -> None:
    """`placements`: (Ray node id, address a rank advertises). Raises ValueError when ranks on
    different nodes advertise one address (PDSERVE_NODE_IP copied between nodes, say)."""
    seen: dict[str, str] = {}
    for node_id, address in placements:
        if seen.setdefault(address, node_id) != node_id:
            raise ValueError(f"ranks on Ray nodes {seen[address]} and {node_id} both advertise {address}: "
                             f"give each node its own address ({NODE_IP_ENV})")
