"""Linux plumbing for the multi-host test bed (`bench/multihost.py`): a bridge, one network
namespace per host joined to it by a veth pair, one PID namespace per host; and the probes that
watch the bed's Ray cluster and redis from the root namespace.

    root namespace (pytest) ── bridge pb<sfx> (10.213.N.1/24)
                                 ├── pv<sfx>2 ══ eth0 in netns pd<sfx>-head  (10.213.N.2)
                                 ├── pv<sfx>3 ══ eth0 in netns pd<sfx>-gw    (10.213.N.3)
                                 └── ...

A host's namespaces have `lo` and `eth0` only, and one route: the bed's /24. Nothing outside the
bed is reachable from a host (no default route; the root namespace does not forward).

Why a PID namespace per host as well: Ray finds "the local raylet" by scanning the process table
(`ray._private.services.find_node_ids`) and prefers the head's. Without PID namespaces, a driver
in the gateway host would attach to the head node's raylet and advertise an address its own
network namespace does not have. Each host therefore has an init process (`unshare --pid
--mount-proc`, a reaper), and every process of the host is started with `nsenter` into the init's
net, PID and mount namespaces: its `/proc` shows its own host's processes only.

Needs root, iproute2 (`ip`, `bridge`) and util-linux (`unshare`, `nsenter`).
"""
from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# PID 1 of a host's PID namespace: reaps orphans (daemons left by `ray start`), dies with SIGKILL.
_REAPER = ("import os, time\nwhile True:\n    try:\n        os.wait()\n"
           "    except ChildProcessError:\n        time.sleep(0.5)\n")
# Prints the GCS node list as JSON: once (interval 0) or every `interval` seconds.
PROBE = """import json, sys, time
from ray._raylet import GcsClient
client, interval = GcsClient(address=sys.argv[1]), float(sys.argv[2])
while True:
    try:
        infos = client.get_all_node_info(timeout=10)
        print(json.dumps([{"node_id": k.hex(), "ip": i.node_manager_address, "alive": i.state == 0,
                           "is_head": i.is_head_node, "resources": dict(i.resources_total),
                           "death": i.death_info.reason_message} for k, i in infos.items()]), flush=True)
    except Exception as e:
        if interval <= 0:
            raise
        print(json.dumps({"error": repr(e)}), flush=True)
    if interval <= 0:
        break
    time.sleep(interval)
"""
_IPV4 = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})(/\d{1,2})?\b")


def run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs a plumbing command; with `check`, a failure raises RuntimeError carrying its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network or address this machine routes or holds (all routing tables)."""
    text = run(["ip", "-o", "-4", "route", "show", "table", "all"]).stdout
    text += run(["ip", "-o", "-4", "addr"]).stdout
    nets = []
    for addr, plen in _IPV4.findall(text):
        net = ipaddress.ip_network(addr + (plen or "/32"), strict=False)
        if net.prefixlen > 0:
            nets.append(net)
    return nets


def pick_subnet(taken: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """The first 10.213.N.0/24 (N = 1..254) that overlaps nothing in `taken`."""
    for n in range(1, 255):
        cand = ipaddress.ip_network(f"10.213.{n}.0/24")
        if not any(cand.overlaps(t) for t in taken):
            return cand
    raise RuntimeError("no free 10.213.N.0/24 subnet on this machine")


@dataclass
class Link:
    """One host's attachment: its network namespace, the bridge-side veth and its address."""
    netns: str
    veth: str
    ip: str


class Switch:
    """The bridge of one bed and the veth pairs plugged into it. Names carry the bed's suffix
    (`pb<sfx>`, `pv<sfx><i>`, netns `pd<sfx>-<host>`), so beds never clash."""

    def __init__(self, suffix: str):
        self.suffix = suffix
        self.bridge = f"pb{suffix}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.created = False

    def create(self) -> None:
        """Creates the bridge on a free /24 and gives it the .1 address. A machine-wide lock file
        keeps two beds that start at once from picking the same subnet."""
        lock_path = Path(tempfile.gettempdir()) / "pdserve-multihost.lock"
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = pick_subnet(used_networks())
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self.created = True
            run(["ip", "addr", "add", f"{self.host_ip(1)}/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])

    def host_ip(self, index: int) -> str:
        return str(self.subnet.network_address + index)

    def plug(self, host: str, index: int) -> Link:
        """Creates netns `pd<sfx>-<host>` joined to the bridge, with address .`index`."""
        link = Link(f"pd{self.suffix}-{host}", f"pv{self.suffix}{index}", self.host_ip(index))
        run(["ip", "netns", "add", link.netns])
        run(["ip", "link", "add", link.veth, "type", "veth", "peer", "name", "eth0", "netns", link.netns])
        run(["ip", "link", "set", link.veth, "master", self.bridge, "up"])
        run(["ip", "-n", link.netns, "addr", "add", f"{link.ip}/24", "dev", "eth0"])
        run(["ip", "-n", link.netns, "link", "set", "eth0", "up"])
        run(["ip", "-n", link.netns, "link", "set", "lo", "up"])
        return link

    @staticmethod
    def cut(link: Link, keep_carrier: bool = True) -> None:
        """Packets to and from the host vanish (no RST, no ICMP). `keep_carrier`: the bridge port
        stops forwarding while both ends stay up, so the host does not notice (a partition);
        otherwise the bridge-side veth goes down and the host's eth0 loses its carrier."""
        if keep_carrier:
            run(["bridge", "link", "set", "dev", link.veth, "state", "0"])  # 0 = disabled
        else:
            run(["ip", "link", "set", link.veth, "down"])

    @staticmethod
    def restore(link: Link) -> None:
        """Undoes `cut` (either kind)."""
        run(["ip", "link", "set", link.veth, "up"])
        run(["bridge", "link", "set", "dev", link.veth, "state", "3"])  # 3 = forwarding

    @staticmethod
    def slow(link: Link, rate: str = "1mbit") -> None:
        """Both directions of the host's link shaped to `rate` (a token bucket, `tc tbf`, on the
        bridge-side veth and on the host's eth0). NOTE: not `netem` delay or loss: this machine's
        kernel has no sch_netem; a bucket's queue (up to 500 ms) is the delay a slow link adds."""
        for prefix in ([], ["-n", link.netns]):
            dev = "eth0" if prefix else link.veth
            run(["tc", *prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kb",
                 "latency", "500ms"])

    @staticmethod
    def unslow(link: Link) -> None:
        """Undoes `slow` (the default queue again)."""
        for prefix in ([], ["-n", link.netns]):
            run(["tc", *prefix, "qdisc", "del", "dev", "eth0" if prefix else link.veth, "root"], check=False)

    @staticmethod
    def unplug(link: Link) -> None:
        """Deletes the veth pair and the netns name (kill the host's processes first)."""
        run(["ip", "link", "del", link.veth], check=False)
        run(["ip", "netns", "del", link.netns], check=False)

    def destroy(self) -> None:
        if self.created:
            run(["ip", "link", "del", self.bridge], check=False)
            self.created = False


def netns_pids(netns: str) -> list[int]:
    """Pids of every process in the network namespace (iproute2's `ip netns pids`)."""
    out = run(["ip", "netns", "pids", netns], check=False).stdout
    return [int(p) for p in out.split()]


def kill_netns(netns: str, timeout: float = 10.0) -> None:
    """SIGKILLs every process in the network namespace until none is left (a host dies)."""
    deadline = time.monotonic() + timeout
    while pids := netns_pids(netns):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of {netns} survive SIGKILL")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def child_pid(pid: int, timeout: float = 5.0) -> int | None:
    """The (only) child of `pid`, waiting up to `timeout` for it to be forked; None if `pid` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            return None
        if children:
            return int(children[0])
        time.sleep(0.01)
    return None


def _die_with_parent() -> None:
    # NOTE: PR_SET_PDEATHSIG fires when the *thread* that forked us exits: start hosts from a
    # long-lived thread. It makes a host's init (and so its whole PID namespace) die with the bed.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def start_init(netns: str, log) -> tuple[subprocess.Popen, int]:
    """Starts a host's init (PID 1 of a new PID namespace, inside `netns`, with its own /proc).

    Returns:
        (the `unshare` process, the init's pid as the root namespace sees it: `nsenter --target`)
    """
    argv = ["ip", "netns", "exec", netns, "unshare", "--pid", "--kill-child", "--mount-proc",
            sys.executable, "-c", _REAPER]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent)
    init_pid = child_pid(proc.pid)
    if init_pid is None:
        raise RuntimeError(f"the init of {netns} did not start (exit {proc.poll()})")
    return proc, init_pid


def nsenter_argv(init_pid: int, cwd: str) -> list[str]:
    """Prefix that runs a command inside the host whose init is `init_pid` (net, PID, mount)."""
    return ["nsenter", f"--target={init_pid}", "--net", "--pid", "--mount", f"--wd={cwd}", "--"]


class HostPopen(subprocess.Popen):
    """A process started through `nsenter_argv`: `pid` is nsenter's (it exits with the command's
    status); `send_signal` (so `terminate` and `kill`) goes to the command itself."""

    _inner: int | None = None

    @property
    def inner_pid(self) -> int | None:
        """The command's pid in the root namespace; None once it has exited."""
        if self._inner is None and self.poll() is None:
            self._inner = child_pid(self.pid)
        return self._inner if self.poll() is None else None

    def send_signal(self, sig: int) -> None:
        inner = self.inner_pid
        if inner is not None:
            try:
                os.kill(inner, sig)
                return
            except ProcessLookupError:
                pass
        super().send_signal(sig)


def bed_root() -> Path:
    """Where beds keep their directories: the temp dir, if short (unix socket paths under a
    Ray node's temp dir must stay below 107 characters)."""
    return Path(tempfile.gettempdir() if len(tempfile.gettempdir()) <= 20 else "/tmp")


def wait_redis(ip: str, port: int, proc: subprocess.Popen, deadline: float) -> bool:
    """Whether redis at ip:port answers PING before `deadline` (monotonic) while `proc` lives."""
    import redis
    client = redis.Redis(host=ip, port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping():
                    return True
            except redis.RedisError:
                time.sleep(0.1)
        return False
    finally:
        client.close()


def gcs_nodes(address: str, env: dict) -> list[dict]:
    """The GCS node list (see PROBE), asked once from this namespace; RuntimeError on failure."""
    proc = subprocess.run([sys.executable, "-c", PROBE, address, "0"], capture_output=True, text=True,
                          timeout=60, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"node list failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def watch_gcs(address: str, env: dict, predicate, timeout: float, what: str) -> list[dict]:
    """Polls the GCS node list (one probe process, every 0.2 s) until `predicate(nodes)` holds."""
    probe = subprocess.Popen([sys.executable, "-c", PROBE, address, "0.2"], text=True, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline, last = time.monotonic() + timeout, None
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([probe.stdout], [], [], left)[0]:
            line = probe.stdout.readline()
            if not line:
                break
            last = json.loads(line)
            if isinstance(last, list) and predicate(last):
                return last
    finally:
        probe.kill()
        probe.wait()
    raise TimeoutError(f"{what} not reached within {timeout} s; last node list: {last}")


def cleanup_stale(root: Path) -> list[str]:
    """Removes the namespaces, links and directories of beds whose owner process is gone (a test
    run killed before its teardown); live beds are left alone. Returns what it removed."""
    def owner_alive(sfx: str) -> bool:
        try:
            os.kill(int((root / f"pdb-{sfx}" / "owner").read_text()), 0)
            return True
        except (OSError, ValueError):
            return False
    removed = []
    for netns in [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line]:
        if (m := re.match(r"pd([0-9a-f]{6})-", netns)) and not owner_alive(m[1]):
            kill_netns(netns)
            run(["ip", "netns", "del", netns], check=False)
            removed.append(f"netns {netns}")
    for line in run(["ip", "-o", "link"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (m := re.fullmatch(r"p[bv]([0-9a-f]{6})\d*", name)) and not owner_alive(m[1]):
            run(["ip", "link", "del", name], check=False)
            removed.append(f"link {name}")
    for path in root.glob("pdb-*"):
        if re.fullmatch(r"pdb-[0-9a-f]{6}", path.name) and not owner_alive(path.name[4:]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"dir {path}")
    return removed
