"""A multi-host test bed on one Linux machine: every "host" is a network namespace (own address
on a private /24, reachable from the root namespace over a bridge) with its own PID namespace,
running a real Ray node, redis-server or gateway, or nothing yet (a "pod" host: what runs there
is started by its user, e.g. `bench/chart_pods.py`). Plumbing in `bench/multihost_net.py`.

    with Bed(default_hosts()) as bed:          # or bed = Bed(hosts).up() ... bed.down()
        bed.wait_nodes(5, timeout=60)
        proc = bed.popen("gw", [".venv/bin/pdserve", "serve", "--ray-address", bed.ray_address, ...])
        bed.kill_host("d1")                    # SIGKILL everything on d1: the host died
        bed.restart_host("d1")                 # its Ray node joins again

Ray token auth is on: every process in a host gets RAY_AUTH_MODE=token and the bed's token.
`python -m bench.multihost` brings one up and prints how to use it. Needs root.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import multihost_net as net

logger = logging.getLogger(__name__)

BIN = Path(sys.executable).parent  # the venv's bin: ray, pdserve
ROLES = ("head", "gateway", "redis", "prefill", "decode", "worker", "pod")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PORT = 6379  # the GCS port on the head, redis' port on the redis host
# The GCS declares a node dead once health checks fail: with Ray's defaults, measured here, ~15 s
# after its raylet is killed and ~65 s after its link is cut. `Bed(hosts, extra_env=FAST_FAILURE_DETECTION)`
# makes both ~5 s. NOTE: so short a timeout risks false deaths while a 2-core machine loads models.
FAST_FAILURE_DETECTION = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                          "RAY_health_check_failure_threshold": "3"}


@dataclass(frozen=True)
class HostSpec:
    """One host. `role`: head (the GCS), gateway (a Ray node with no CPUs, for drivers), redis,
    prefill / decode / worker (Ray nodes), pod (starts nothing and joins no Ray by itself).
    `num_cpus` and `resources` are what its `ray start` advertises (logical; the machine's real
    cores are shared by all hosts)."""
    name: str
    role: str
    num_cpus: int = 0
    resources: dict = field(default_factory=dict)
    object_store_mb: int = 256

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", self.name):
            raise ValueError(f"host name {self.name!r}: 1-10 chars of [a-z0-9], starting with a letter")
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} not in {ROLES}")

    @property
    def joins_ray(self) -> bool:
        return self.role not in ("redis", "pod")


def default_hosts(num_prefill: int = 1, num_decode: int = 2, prefill_cpus: int = 2,
                  decode_cpus: int = 2) -> list[HostSpec]:
    """head, gw, redis, p1..pN (resource {"prefill": cpus}), d1..dM ({"decode": cpus})."""
    hosts = [HostSpec("head", "head"), HostSpec("gw", "gateway"), HostSpec("redis", "redis")]
    hosts += [HostSpec(f"p{i + 1}", "prefill", prefill_cpus, {"prefill": prefill_cpus}) for i in range(num_prefill)]
    hosts += [HostSpec(f"d{i + 1}", "decode", decode_cpus, {"decode": decode_cpus}) for i in range(num_decode)]
    return hosts


@dataclass
class Host:
    spec: HostSpec
    link: net.Link
    init: subprocess.Popen | None = None
    init_pid: int | None = None  # PID 1 of its PID namespace, as the root namespace sees it
    procs: list = field(default_factory=list)


class Bed:
    """A set of hosts (see the module docstring). Nothing runs until `up()`; `down()` undoes
    everything and may be called any number of times, also after a failed `up()`."""

    def __init__(self, hosts: list[HostSpec], extra_env: dict | None = None, start_timeout: float = 180.0):
        names = [h.name for h in hosts]
        if len(set(names)) != len(names) or [h.role for h in hosts].count("head") > 1:
            raise ValueError(f"need unique host names and at most one head (none: no Ray of the bed's own): {hosts}")
        self.specs, self.extra_env, self.start_timeout = list(hosts), dict(extra_env or {}), start_timeout
        self.suffix = secrets.token_hex(3)
        self.token = secrets.token_hex(32)
        self.dir = net.bed_root() / f"pdb-{self.suffix}"  # short: unix socket paths stay under 107 chars
        self.switch = net.Switch(self.suffix)
        self.hosts: dict[str, Host] = {}
        self._next_index = 2  # .1 is the bridge

    # -- addresses --------------------------------------------------------------------------------
    def address(self, name: str) -> str:
        """The host's IPv4 address."""
        return self.hosts[name].link.ip

    def _by_role(self, role: str) -> str:
        """The first host of `role` (KeyError if none)."""
        for name, host in self.hosts.items():
            if host.spec.role == role:
                return name
        raise KeyError(f"the bed has no {role} host")

    @property
    def ray_address(self) -> str:
        """The head's GCS address, HEAD_IP:6379 (`ray start --address`, `ray.init(address=...)`)."""
        return f"{self.address(self._by_role('head'))}:{PORT}"

    @property
    def redis_url(self) -> str:
        """redis://REDIS_IP:6379/0, for `pdserve serve --redis-url`."""
        return f"redis://{self.address(self._by_role('redis'))}:{PORT}/0"

    def env(self) -> dict[str, str]:
        """The variables any Ray process of this bed needs (token auth)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0"}

    def _process_env(self, env: dict | None, inherit: bool = True) -> dict[str, str]:
        if not inherit:  # a container's: the image's PATH and HOME, and `env`
            return {"PATH": f"{BIN}{os.pathsep}{DEFAULT_PATH}", "HOME": os.environ.get("HOME", "/root"), **(env or {})}
        drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")
        full = {k: v for k, v in os.environ.items() if k not in drop}
        full["PATH"] = f"{BIN}{os.pathsep}{full.get('PATH', '')}"
        return {**full, **self.env(), **self.extra_env, **(env or {})}

    # -- life cycle -------------------------------------------------------------------------------
    def up(self) -> Bed:
        """Creates the bridge and every host, starts the head, then everything else in parallel;
        returns once each Ray node is alive and redis answers PING. Tears down on failure."""
        t0 = time.monotonic()
        self.dir.mkdir(mode=0o755)
        try:
            (self.dir / "owner").write_text(str(os.getpid()))
            self.switch.create()
            for spec in self.specs:
                self._plug(spec)
            heads = [n for n, h in self.hosts.items() if h.spec.role == "head"]
            self._start_hosts(heads)
            self._start_hosts([n for n in self.hosts if n not in heads])
            if heads:
                self.wait_nodes(sum(h.spec.joins_ray for h in self.hosts.values()), self.start_timeout)
        except BaseException:
            self.down()
            raise
        logger.info("bed %s up in %.1f s: %s", self.suffix, time.monotonic() - t0, self.switch.subnet)
        return self

    def __enter__(self) -> Bed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def _plug(self, spec: HostSpec) -> Host:
        host = Host(spec, self.switch.plug(spec.name, self._next_index))
        self._next_index += 1
        self.hosts[spec.name] = host
        return host

    def _start_hosts(self, names: list[str]) -> None:
        """Starts each host's init and role process, then waits for all (they start in parallel)."""
        deadline = time.monotonic() + self.start_timeout
        started = []
        for name in names:
            host = self.hosts[name]
            (self.dir / name).mkdir(exist_ok=True)
            with open(self.log_path(name), "ab") as log:
                host.init, host.init_pid = net.start_init(host.link.netns, log)
            if host.spec.role != "pod":
                started.append((name, self.popen(name, self._role_argv(host.spec, host.link.ip))))
        for name, proc in started:
            self._await_role(name, proc, deadline)

    def _role_argv(self, spec: HostSpec, ip: str, bed_flags: bool = True) -> list[str]:
        """The command that starts the host's role; without `bed_flags`, as typed on a real machine."""
        if spec.role == "redis":
            argv = ["redis-server", "--bind", ip, "--port", str(PORT), "--save", "", "--appendonly", "no",
                    "--protected-mode", "no"]
            return argv + (["--dir", str(self.dir / spec.name)] if bed_flags else [])
        argv = ["ray", "start"] + (["--head", "--port", str(PORT)] if spec.role == "head" else
                                   ["--address", self.ray_address])
        argv += ["--node-ip-address", ip, "--num-cpus", str(spec.num_cpus)]
        argv += ["--include-dashboard=false"] if spec.role == "head" else []
        if spec.resources:
            argv += ["--resources", json.dumps(spec.resources)]
        if bed_flags:  # NOTE: Ray nodes on one machine need their own temp dirs (sockets, logs).
            argv[0] = str(BIN / "ray")
            argv += ["--temp-dir", str(self.dir / spec.name), "--disable-usage-stats",
                     "--object-store-memory", str(spec.object_store_mb << 20)]
        return argv

    def _await_role(self, name: str, proc: net.HostPopen, deadline: float) -> None:
        if self.hosts[name].spec.role == "redis":
            return self._await_redis(name, proc, deadline)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            raise RuntimeError(f"ray start on {name} failed ({rc}); Ray's logs: {self.dir / name}/session_latest/logs"
                               f"\n{self.log_tail(name)}")

    def _await_redis(self, name: str, proc: net.HostPopen, deadline: float) -> None:
        if not net.wait_redis(self.address(name), PORT, proc, deadline):
            raise RuntimeError(f"redis-server on {name} did not answer PING ({proc.poll()})\n{self.log_tail(name)}")

    def add_host(self, spec: HostSpec) -> None:
        """Adds a host to a running bed and starts its role (a Ray node joins the cluster)."""
        if spec.name in self.hosts or spec.role == "head":
            raise ValueError(f"cannot add {spec}")
        self._plug(spec)
        self._start_hosts([spec.name])
        if spec.joins_ray:
            self.wait_node(spec.name, alive=True, timeout=self.start_timeout)

    def remove_host(self, name: str) -> None:
        """Kills the host and unplugs it: its namespaces and address are gone."""
        self.kill_host(name)
        net.Switch.unplug(self.hosts.pop(name).link)

    def kill_host(self, name: str) -> None:
        """SIGKILLs every process in the host (its init, so its whole PID namespace, included)."""
        host = self.hosts[name]
        net.kill_netns(host.link.netns)
        for proc in [host.init, *host.procs]:
            if proc is not None:
                proc.wait()
        host.init, host.init_pid, host.procs = None, None, []

    def restart_host(self, name: str) -> None:
        """Starts a (killed) host again: a new init and its role; waits until its node is alive.
        A cut link stays cut. The head comes back as a new, empty Ray cluster (no GCS persistence)."""
        self.kill_host(name)
        self._start_hosts([name])
        if self.hosts[name].spec.joins_ray:
            self.wait_node(name, alive=True, timeout=self.start_timeout)

    def cut_link(self, name: str, keep_carrier: bool = True) -> None:
        """Packets to and from the host vanish from now on (no RST); see `Switch.cut`."""
        net.Switch.cut(self.hosts[name].link, keep_carrier)

    def restore_link(self, name: str) -> None:
        net.Switch.restore(self.hosts[name].link)

    def slow_link(self, name: str, rate: str = "1mbit") -> None:
        """The host's link shaped to `rate` both ways until `unslow_link` (see `Switch.slow`)."""
        net.Switch.slow(self.hosts[name].link, rate)

    def unslow_link(self, name: str) -> None:
        net.Switch.unslow(self.hosts[name].link)

    def down(self) -> None:
        """Kills every process of every host, deletes namespaces, veths, the bridge and the bed's
        directory. Idempotent; errors are logged, never raised."""
        for name, host in list(self.hosts.items()):
            try:
                self.kill_host(name)
            except Exception:
                logger.exception("bed %s: killing host %s", self.suffix, name)
            net.Switch.unplug(host.link)
            del self.hosts[name]
        self.switch.destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- processes --------------------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def log_tail(self, name: str, num_lines: int = 40, path: Path | None = None) -> str:
        """The last lines of a host's log (or of `path`), for error messages."""
        try:
            lines = (path or self.log_path(name)).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def popen(self, name: str, argv: list[str], env: dict | None = None, log: Path | None = None,
              cwd: str | None = None, inherit_env: bool = True) -> net.HostPopen:
        """Starts `argv` inside the host (its network, PID and mount namespaces) with `env()` and
        `env` on top of this process' environment (without `inherit_env`: `env` and a PATH with the
        venv's bin only); output appends to `log` (default: the host's log). The bed kills it with
        the host. `terminate()`/`kill()` signal the command itself."""
        with open(log or self.log_path(name), "ab") as out:
            proc = net.HostPopen(self._enter(name, cwd) + list(argv), env=self._process_env(env, inherit_env),
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self.hosts[name].procs.append(proc)
        return proc

    def run(self, name: str, argv: list[str], timeout: float = 60, env: dict | None = None,
            inherit_env: bool = True) -> subprocess.CompletedProcess:
        """Runs `argv` inside the host to completion (env as `popen`'s); returns its exit status and
        text output. Past `timeout` the command is killed and TimeoutExpired raised."""
        with net.HostPopen(self._enter(name, None) + list(argv), env=self._process_env(env, inherit_env), text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()  # the command itself, not only nsenter
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _enter(self, name: str, cwd: str | None) -> list[str]:
        if self.hosts[name].init_pid is None:
            raise RuntimeError(f"host {name} is not running (killed?)")
        return net.nsenter_argv(self.hosts[name].init_pid, cwd or os.getcwd())

    # -- Ray's view -------------------------------------------------------------------------------
    def nodes(self, env: dict | None = None) -> list[dict]:
        """Every node the GCS knows (alive or dead): node_id, ip, alive, is_head, resources, death.
        Asked from the root namespace; `env` overrides the token variables (RuntimeError on failure)."""
        return net.gcs_nodes(self.ray_address, {**self._process_env(None), **(env or {})})

    def wait_for(self, predicate, timeout: float, what: str = "condition") -> list[dict]:
        """Polls the GCS node list (every 0.2 s) until `predicate(nodes)` holds; returns that list.
        Raises TimeoutError (with the last list) after `timeout` seconds."""
        return net.watch_gcs(self.ray_address, self._process_env(None), predicate, timeout, what)

    def wait_nodes(self, num_nodes: int, timeout: float) -> list[dict]:
        """Waits until exactly `num_nodes` nodes are alive."""
        return self.wait_for(lambda ns: sum(n["alive"] for n in ns) == num_nodes, timeout,
                             f"{num_nodes} alive nodes")

    def wait_node(self, name: str, alive: bool, timeout: float) -> list[dict]:
        """Waits until the host has an alive Ray node (`alive`), or none (it died in Ray's view)."""
        ip = self.address(name)
        return self.wait_for(lambda ns: any(n["alive"] and n["ip"] == ip for n in ns) == alive, timeout,
                             f"node {name} ({ip}) {'alive' if alive else 'dead'}")

    # -- for people -------------------------------------------------------------------------------
    def describe(self) -> str:
        """Hosts, addresses and the commands a person would type on real machines."""
        lines = [f"bed {self.suffix}: subnet {self.switch.subnet}, this namespace is {self.switch.host_ip(1)}, "
                 f"files in {self.dir}", f"{'host':8} {'role':8} {'address':14} {'netns':16} init pid"]
        lines += [f"{n:8} {h.spec.role:8} {h.link.ip:14} {h.link.netns:16} {h.init_pid}" for n, h in self.hosts.items()]
        lines += ["", "On real machines (one per host), the same token everywhere:",
                  f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN={self.token}"]
        for n, h in self.hosts.items():
            if h.spec.role != "pod":
                lines.append(f"  [{n}] {shlex.join(self._role_argv(h.spec, h.link.ip, bed_flags=False))}")
        if not any(h.spec.role == "gateway" for h in self.hosts.values()):
            return "\n".join(lines)
        gw = self._by_role("gateway")
        lines.append(f"  [{gw}] pdserve serve --ray-address {self.ray_address} --redis-url {self.redis_url} "
                     f"--ray-resources --host {self.address(gw)} --port 8000")
        env = " ".join(f"{k}={v}" for k, v in self.env().items())
        lines += ["", "Here, run a command inside a host (its network, processes and /proc), e.g. the gateway:",
                  f"  nsenter --target={self.hosts[gw].init_pid} --net --pid --mount -- env {env} "
                  f"{BIN / 'ray'} status --address {self.ray_address}",
                  f"  (network only, every host's processes in sight: ip netns exec {self.hosts[gw].link.netns} CMD)"]
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multihost", allow_abbrev=False,
                                description="Bring up a multi-host test bed (network namespaces; needs root), "
                                            "print how to use it, tear it down on Ctrl-C.")
    p.add_argument("--prefill", type=int, default=1, help="prefill hosts")
    p.add_argument("--decode", type=int, default=2, help="decode hosts")
    p.add_argument("--prefill-cpus", type=int, default=2, help="logical CPUs (and prefill resource) per prefill host")
    p.add_argument("--decode-cpus", type=int, default=2, help="logical CPUs (and decode resource) per decode host")
    p.add_argument("--cleanup", action="store_true", help="remove what beds of dead processes left, then exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.cleanup:
        return print("\n".join(net.cleanup_stale(net.bed_root())) or "nothing to clean")
    for sig in (signal.SIGINT, signal.SIGTERM):  # both tear down (SIGINT is ignored in background jobs)
        signal.signal(sig, signal.default_int_handler)
    bed = Bed(default_hosts(args.prefill, args.decode, args.prefill_cpus, args.decode_cpus))
    try:
        t0 = time.monotonic()
        bed.up()
        print(bed.describe(), f"\n\nup in {time.monotonic() - t0:.1f} s; Ctrl-C tears it down.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        t0 = time.monotonic()
        bed.down()
        print(f"down in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
