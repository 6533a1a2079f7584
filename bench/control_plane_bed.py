"""The bed of the control-plane benchmark (bench/control_plane.py): a real Redis, a local Ray, the
simulated hosts (bench/sim_instances.py), the real controller over them (`SimController`: the
Controller with instances created on the hosts instead of as rank actors) and G real gateway
processes (bench/control_plane_gateway.py). Everything on loopback; `Bed.close()` stops it all."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.sim_instances import HOST_PREFIX, MemberHandle, SimHost, host_name
from cluster.autoscale.autoscaler import Profile
from cluster.control.controller import Controller
from cluster.control.instance import Instance
from cluster.ranks.nodes import RankPlacement
from cluster.control.serving import ray_client
from cluster.spec import ClusterSpec
from kvtransfer.params import KVEndpoint
from router.client import InstanceInfo

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
PER_HOST = 250  # simulated instances per host actor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimController(Controller):
    """The controller, its instances on SimHosts: created there (after `startup_s`, a simulated cold
    start), probed, heartbeated, drained, replaced as any; killed by making them silent."""

    def __init__(self, spec: ClusterSpec, num_hosts: int, startup_s: float = 0.0):
        super().__init__(spec)
        self.num_hosts, self.startup_s = num_hosts, startup_s
        self.probe_s: list[float] = []  # each probe cycle's seconds (_probe_all)

    def host(self, instance_id: str):
        import ray
        return ray.get_actor(host_name(instance_id, self.num_hosts), namespace=self.spec.cluster_name)

    def _create_ray(self, role: str, iid: str, tp: int) -> Instance:
        import ray
        time.sleep(self.startup_s)
        host = self.host(iid)
        ray.get(host.create.remote(iid, role))
        number = int(iid.rpartition("-")[2])
        endpoints = (KVEndpoint(iid, 0, "127.0.0.1", 1 + number % 65000),) if role == "decode" else ()
        info = InstanceInfo(iid, role, 1, endpoints, max_model_len=8192, block_size=16, engine={"simulated": "yes"})
        handle = MemberHandle(host, iid)
        return Instance(iid, role, 1, [handle], ray_client(info, handle, self.spec.heartbeat_ttl_s),
                        placements=[RankPlacement(0, "127.0.0.1", os.getpid(), {})])

    def _probe_all(self, ttl: float) -> None:
        start = time.perf_counter()
        super()._probe_all(ttl)
        self.probe_s.append(time.perf_counter() - start)

    def _destroy(self, inst: Instance, dead: bool = False) -> None:
        import ray
        handle, inst.ranks = inst.ranks[0], []  # (the base kills rank actors: a member has none of its own)
        super()._destroy(inst, dead)
        if not dead:
            ray.get(handle.shutdown.remote(), timeout=10)

    def kill_instance(self, instance_id: str) -> None:
        """The instance stops answering (a host cut off): the probe finds it dead."""
        import ray
        ray.get(self.host(instance_id).silence.remote(instance_id))


def _start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    import redis
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


class Bed:
    """Redis, Ray, `num_instances` simulated instances (half prefill) under a SimController, and
    `num_gateways` gateway processes."""

    def __init__(self, num_instances: int, num_gateways: int, profile: Profile, heartbeat_ttl_s: float = 5.0,
                 startup_s: float = 0.0):
        self.workdir = tempfile.mkdtemp(prefix="pdserve-control-plane-")
        self.redis, self.redis_port = _start_redis(self.workdir)
        self.num_hosts = max(1, math.ceil(num_instances / PER_HOST))
        num_prefill = num_instances // 2
        self.spec = ClusterSpec(model="smollm2", device="cpu", num_prefill=num_prefill,
                                num_decode=num_instances - num_prefill,
                                redis_url=f"redis://127.0.0.1:{self.redis_port}/0",
                                ray_address="pending", heartbeat_ttl_s=heartbeat_ttl_s, cluster_name="control-plane",
                                max_num_seqs=profile.max_num_seqs, kv_transfer_timeout_s=30.0)
        self.profile, self.gateways, self.ports = profile, [], []
        self.controller: SimController | None = None
        self._start_ray()
        self._start_controller(startup_s)
        self._start_gateways(num_gateways)

    def _start_ray(self) -> None:
        from cluster.control.instance import setup_ray_auth
        import ray
        setup_ray_auth()
        ray.init(num_cpus=4, include_dashboard=False, namespace=self.spec.cluster_name, logging_level="WARNING",
                 log_to_driver=False)
        self.spec = dataclasses.replace(self.spec, ray_address=ray.get_runtime_context().gcs_address)
        host_cls = ray.remote(SimHost)
        self.hosts = [host_cls.options(name=f"{HOST_PREFIX}{k}", namespace=self.spec.cluster_name, num_cpus=0,
                                       max_concurrency=100_000).remote(dataclasses.asdict(self.profile),
                                                                       self.num_hosts, self.spec.cluster_name)
                      for k in range(self.num_hosts)]
        ray.get([h.stats.remote() for h in self.hosts])

    def _start_controller(self, startup_s: float) -> None:
        start = time.monotonic()
        self.controller = SimController(self.spec, self.num_hosts, startup_s).start()
        self.controller_start_s = time.monotonic() - start

    def _start_gateways(self, count: int) -> None:
        spec_path = Path(self.workdir) / "spec.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(self.spec)))
        start = time.monotonic()
        for _ in range(count):
            port = free_port()
            log = open(Path(self.workdir) / f"gateway-{port}.log", "w")
            self.gateways.append(subprocess.Popen(
                [sys.executable, "-m", "bench.control_plane_gateway", "--spec", str(spec_path), "--num-hosts",
                 str(self.num_hosts), "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            self.ports.append(port)
        want = set(self.controller.instances)
        self.wait(lambda stats: want <= set(stats["instances"]), 120 + len(want) / 5, "every gateway attaches all")
        self.gateways_ready_s = time.monotonic() - start

    def stats(self, port: int) -> dict | None:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/bench/stats", timeout=30).json()
        except httpx.HTTPError:
            return None

    def wait(self, done, timeout_s: float, what: str) -> float:
        """Seconds until `done(stats)` holds on every gateway (polled every 50 ms)."""
        start, pending = time.monotonic(), set(self.ports)
        while pending:
            for port in list(pending):
                stats = self.stats(port)
                if stats is not None and done(stats):
                    pending.discard(port)
            if any(g.poll() is not None for g in self.gateways):
                raise RuntimeError(f"a gateway exited (logs in {self.workdir})")
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (logs in {self.workdir})")
            time.sleep(0.05)
        return time.monotonic() - start

    def redis_commands(self) -> int:
        import redis
        return int(redis.Redis(host="127.0.0.1", port=self.redis_port).info("stats")["total_commands_processed"])

    def close(self) -> None:
        import ray
        for g in self.gateways:
            g.terminate()
        for g in self.gateways:
            try:
                g.wait(10)
            except subprocess.TimeoutExpired:
                g.kill()
        if self.controller is not None:
            self.controller.shutdown(stop_instances=False)
        ray.shutdown()
        self.redis.terminate()
        self.redis.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)
