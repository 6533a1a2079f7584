"""The cluster state's backends by URL: `create_state` picks `MemoryState` (cluster/state.py) or
`RedisState` (cluster/redis_state.py). The factory of this axis, beside the interface
(state.py: ClusterState), which imports no backend; a leaf like it (DESIGN.md)."""
from __future__ import annotations

from cluster.state import ClusterState, MemoryState


def create_state(url: str | None = None, namespace: str = "pdserve") -> ClusterState:
    """Returns `MemoryState` for None or "memory://", `RedisState` for "redis://...",
    "rediss://..." or "unix://..." (keys under `namespace`: one cluster's); raises ValueError for
    anything else."""
    if url is None or url == "memory://":
        return MemoryState()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from cluster.redis_state import RedisState
        return RedisState(url, namespace)
    from cluster.redis_client import mask_url
    raise ValueError(f"unsupported cluster state url {mask_url(url)!r}: use memory:// or redis://host:port/db")
