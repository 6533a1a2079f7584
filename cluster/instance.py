"""An instance as its owner sees it, the name of its rank actors, and joining Ray."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from cluster import nodes
from cluster.spec import ClusterSpec


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


def rank_actor_name(instance_id: str, rank: int) -> str:
    """The Ray actor name of one rank (in the cluster's Ray namespace)."""
    return f"{instance_id}.rank{rank}"


def setup_ray_auth() -> None:
    """Token authentication for a local Ray cluster: on, with a fresh per-cluster token unless the
    operator provided one (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH). Nothing is written to ~/.ray."""
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
        ray.init(num_cpus=max(os.cpu_count() or 1, ranks + 2), include_dashboard=False,
                 logging_level=log_level, log_to_driver=log_level == "DEBUG")
    else:
        ray.init(address=spec.ray_address, namespace=spec.cluster_name, logging_level=log_level)
    return True
