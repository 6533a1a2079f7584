"""The multi-host test bed itself: addresses, isolation, Ray's view, token auth, redis, and the
faults it injects (a host dying, a link cut). Tests that break a host restore it."""
from __future__ import annotations

import ipaddress
import json
import socket
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(600)

# A one-shot TCP server: tells each client (n of them) which address it came from.
LISTEN = """import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
for _ in range(int(sys.argv[3])):
    conn, peer = server.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""
CONNECT = """import socket, sys, time
for _ in range(200):
    try:
        print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).recv(100).decode())
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
"""
# A Ray driver: where it runs, where role-placed tasks run, and a ref it owns borrowed by a task.
DRIVER = """import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
where = ray.remote(num_cpus=1)(lambda: ray.util.get_node_ip_address())
borrow = ray.remote(num_cpus=1)(lambda refs: len(ray.get(refs[0])))
print(json.dumps({"driver_ip": ray.util.get_node_ip_address(),
                  "prefill_ip": ray.get(where.options(resources={"prefill": 1}).remote(), timeout=120),
                  "decode_ip": ray.get(where.options(resources={"decode": 1}).remote(), timeout=120),
                  "borrowed": ray.get(borrow.options(resources={"decode": 1}).remote([ray.put(b"x" * 10)]),
                                      timeout=120)}))
"""
ROLE_RESOURCES = {"head": {}, "gw": {}, "p1": {"CPU": 2, "prefill": 2}, "d1": {"CPU": 3, "decode": 3},
                  "d2": {"CPU": 2, "decode": 2}}


def _alive_by_ip(nodes: list[dict]) -> dict[str, dict]:
    return {n["ip"]: n for n in nodes if n["alive"]}


def _connect(host: str, port: int, timeout: float) -> str:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        return conn.recv(100).decode()


def test_hosts_have_own_addresses_and_no_route_out(bed):
    """Each host has its own address in the bed's /24 on eth0, plus lo, and one route (the /24):
    nothing outside the bed is reachable from a host."""
    subnet = ipaddress.ip_network(bed.switch.subnet)
    addresses = {name: bed.address(name) for name in bed.hosts}
    assert len(set(addresses.values())) == len(addresses)
    for name, ip in addresses.items():
        assert ipaddress.ip_address(ip) in subnet and ip != bed.switch.host_ip(1)
        addrs = bed.run(name, ["ip", "-4", "-o", "addr"]).stdout
        assert [line.split()[1] for line in addrs.splitlines()] == ["lo", "eth0"] and f"{ip}/24" in addrs
        routes = bed.run(name, ["ip", "-4", "route"]).stdout.splitlines()
        assert len(routes) == 1 and routes[0].startswith(f"{subnet} dev eth0"), routes


def test_hosts_reach_each_other_over_tcp(bed):
    """A TCP server in d1 is reached from p1 (the server sees p1's own address) and from the root
    namespace (it sees the bridge's .1)."""
    d1 = bed.address("d1")
    server = bed.popen("d1", [sys.executable, "-c", LISTEN, d1, "7000", "2"])
    client = bed.run("p1", [sys.executable, "-c", CONNECT, d1, "7000"], timeout=30)
    assert client.stdout.strip() == bed.address("p1"), client.stderr
    assert _connect(d1, 7000, timeout=5) == bed.switch.host_ip(1)
    assert server.wait(timeout=10) == 0


def test_each_host_sees_only_its_own_processes(bed):
    """A host's process table holds its own processes only (a PID namespace per host): on the
    gateway host, Ray's local-raylet discovery finds exactly the gateway's raylet."""
    probe = ("import psutil, json; print(json.dumps([p.info['cmdline'] for p in psutil.process_iter(['cmdline'])"
             " if p.info['cmdline'] and p.info['cmdline'][0].endswith('/raylet')]))")
    raylets = json.loads(bed.run("gw", [sys.executable, "-c", probe]).stdout)
    assert len(raylets) == 1 and f"--node_ip_address={bed.address('gw')}" in raylets[0]


def test_ray_sees_every_node_with_its_address_and_role_resources(bed):
    """Every Ray host is one alive node at its --node-ip-address; only the head is the head, the
    head and the gateway carry no CPUs, workers carry their CPUs and role resources."""
    alive = _alive_by_ip(bed.nodes())
    assert set(alive) == {bed.address(name) for name in ROLE_RESOURCES}
    for name, want in ROLE_RESOURCES.items():
        node = alive[bed.address(name)]
        got = {k: v for k, v in node["resources"].items() if k in ("CPU", "prefill", "decode")}
        assert got == want, (name, node)
        assert node["is_head"] == (name == "head")


@pytest.mark.parametrize("env", [{"RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": ""}])
def test_ray_refuses_a_client_without_the_token(bed, env):
    """Token auth is on: the GCS refuses a client with a wrong token or none."""
    with pytest.raises(RuntimeError, match="InvalidAuthToken"):
        bed.nodes(env=env)


def test_driver_on_gateway_uses_its_own_node_and_tasks_follow_resources(bed):
    """A driver started on the gateway host attaches to the gateway's node (so a task can reach it
    to borrow a ref it owns); `prefill` tasks run on p1, `decode` tasks on d1 or d2."""
    out = bed.run("gw", [sys.executable, "-c", DRIVER, bed.ray_address], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["driver_ip"] == bed.address("gw") and got["prefill_ip"] == bed.address("p1")
    assert got["decode_ip"] in (bed.address("d1"), bed.address("d2")) and got["borrowed"] == 10


def test_redis_answers_from_the_root_namespace(bed):
    """The redis host serves `bed.redis_url` (its own address) to the root namespace."""
    import redis
    assert bed.redis_url == f"redis://{bed.address('redis')}:6379/0"
    client = redis.Redis.from_url(bed.redis_url, socket_timeout=5)
    assert client.ping() and client.set("bed-test", b"v") and client.get("bed-test") == b"v"
    client.delete("bed-test")
    client.close()


def test_kill_host_kills_its_node_and_restart_brings_it_back(bed):
    """After kill_host no process of the host is left and the GCS marks its node dead while the
    others stay alive; restart_host brings a node back at the same address."""
    from bench.multihost_net import netns_pids
    d2, t0 = bed.address("d2"), time.monotonic()
    bed.kill_host("d2")
    assert netns_pids(bed.hosts["d2"].link.netns) == []
    nodes = bed.wait_node("d2", alive=False, timeout=120)
    print(f"d2 dead in Ray's view {time.monotonic() - t0:.1f} s after kill_host")
    assert len(_alive_by_ip(nodes)) == 4
    bed.restart_host("d2")
    node = _alive_by_ip(bed.nodes())[d2]
    assert node["resources"]["decode"] == 2 and len(_alive_by_ip(bed.nodes())) == 5


def test_cut_link_drops_packets_silently_and_restore_heals(bed):
    """While d2's link is cut, a connection to it times out (packets vanish: no refusal, no
    reset); after restore_link the same server answers again."""
    d2 = bed.address("d2")
    server = bed.popen("d2", [sys.executable, "-c", LISTEN, d2, "7001", "2"])
    assert bed.run("p1", [sys.executable, "-c", CONNECT, d2, "7001"]).stdout.strip()
    bed.cut_link("d2")
    try:
        with pytest.raises(TimeoutError):
            _connect(d2, 7001, timeout=2)
    finally:
        bed.restore_link("d2")
    deadline = time.monotonic() + 10
    while True:  # the neighbour entry may need a moment to resolve again
        try:
            assert _connect(d2, 7001, timeout=2) == bed.switch.host_ip(1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
    assert server.wait(timeout=10) == 0
    assert d2 in _alive_by_ip(bed.nodes())
