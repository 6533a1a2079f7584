"""An instance as its owner sees it, the name of its rank actors, and joining Ray."""
from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace

from cluster.ranks import nodes
from cluster.spec import ClusterSpec

logger = logging.getLogger(__name__)

@dataclass
class Instance:
    instance_id: str
    role: str
    tp_size: int
    ranks: list  # RankHost (in-process) or RankActor handles, rank order
    client: object
    placement_group: object = None
    extra: dict = field(default_factory=dict)
    placements: list[nodes.RankPlacement] = field(default_factory=list)  # rank order
    node_id: str | None = None  # the Ray node all its ranks run on (None in-process)

    @property
    def kv_endpoints(self) -> tuple:
        """Decode: its ranks' KV endpoints (as its client knows them)."""
        return self.client.info.kv_endpoints

    def info(self):
        """A copy of its client's InstanceInfo (router/client.py): what readers of the cluster get."""
        return replace(self.client.info)

    def status(self) -> dict:
        """Its row of /status (gateway and controller alike): its info and its ranks' placements."""
        info = self.client.info
        return {"instance_id": self.instance_id, "role": self.role, "tp_size": self.tp_size,
                "healthy": info.healthy, "draining": info.draining, "load": dict(info.load.figures),
                "engine": info.engine, "kv_endpoints": [[e.host, e.port] for e in info.kv_endpoints],
                "ranks": [p.status() for p in self.placements]}


def rank_actor_name(instance_id: str, rank: int) -> str:
    """The Ray actor name of one rank (in the cluster's Ray namespace)."""
    return f"{instance_id}.rank{rank}"


def setup_ray_auth() -> None:
    """Token authentication for a local Ray cluster: on, with a fresh per-cluster token unless the
    operator provided one (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH), and a KV cluster secret of its
    own (PDSERVE_CLUSTER_SECRET, unless given), which the rank actors inherit: the Ray token is
    not the KV key (kvtransfer/wire.py). Nothing is written to ~/.ray."""
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_hex(32))
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not (os.environ.get("RAY_AUTH_TOKEN")
                                                       or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # NOTE: Ray caches its config (auth mode included) when imported; re-read it from the env.
    from ray._raylet import Config
    Config.initialize("")


def init_ray(spec: ClusterSpec, log_level: str, ranks: int = 0) -> bool:
    """Joins `spec.ray_address` (in `spec.cluster_name`) or starts a local Ray for `ranks` rank
    actors; does nothing when this process is connected already. Returns whether it connected."""
    if spec.ray_address is None:
        setup_ray_auth()
    import ray
    if ray.is_initialized():
        return False
    if spec.ray_address is None:
        # the raylet starts workers at this niceness (Ray's default 15); ranks then set the spec's
        # rank_niceness themselves (cluster/ranks/cpu_plan.py), and raising a priority needs CAP_SYS_NICE
        os.environ.setdefault("RAY_worker_niceness", str(max(spec.rank_niceness, 0)))
        ray.init(num_cpus=max(os.cpu_count() or 1, ranks + 2), include_dashboard=False,
                 logging_level=log_level, log_to_driver=log_level == "DEBUG")
    else:
        wait_for_one_node_here(spec.ray_address, nodes.node_address(loopback=False))
        ray.init(address=spec.ray_address, namespace=spec.cluster_name, logging_level=log_level)
    # NOTE: Ray builds a job's serialization context lazily on the first call, importing modules as
    # it goes; two threads racing there (the router's) can fail with KeyError: 'pydantic.v1'.
    ray.get(ray.put(None))
    return True


def wait_for_one_node_here(address: str, ip: str, timeout_s: float = 90.0) -> None:
    """Until the Ray cluster at `address` lists at most one alive node at `ip`. A node restarted
    in place (a pod's container) registers again at its old address while Ray still lists its
    dead predecessor as alive (about 15 s): a driver connecting meanwhile may attach to the dead
    one (Ray picks any node with the driver's address) and hang once Ray declares it dead."""
    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient
    deadline = time.monotonic() + timeout_s
    try:
        gcs = GcsClient(address=canonicalize_bootstrap_address(address))
        while len(here := [n for n in gcs.get_all_node_info(timeout=10).values()
                           if n.state == 0 and n.node_manager_address == ip]) > 1:
            if time.monotonic() > deadline:
                logger.warning("Ray still lists %d alive nodes at %s after %.0f s; connecting anyway",
                               len(here), ip, timeout_s)
                return
            logger.info("Ray lists %d alive nodes at %s (one restarted in place): waiting until it "
                        "declares the old one dead", len(here), ip)
            time.sleep(1)
    except Exception as exc:  # noqa: BLE001 - a check only: ray.init reports real connection errors
        logger.warning("cannot list Ray's nodes before connecting (%s); connecting anyway", exc)
