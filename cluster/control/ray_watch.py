"""A joined process (controller, gateway) whose Ray node left the Ray cluster exits, so that its
pod is started again and joins the cluster it finds then.

Ray has no GCS fault tolerance here: a restarted head is a new, empty Ray cluster. A driver of the
old one keeps its direct actor calls for a while, then finds nothing: its node's raylet gave up,
and names resolve to nothing (a gateway logged "no actor in Ray namespace" for good and answered
503 forever; found by the chaos run's restart_ray_head). `RayMembershipWatch` asks the GCS at the
address it joined, every `interval_s`, whether a node at this process's address is alive there;
once the answer has been no (or no answer) for `grace_s`, it calls `on_lost` once: the CLI sends
its own process SIGTERM (a gateway drains, a controller leaves its instances to the next one).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


def node_alive_at(gcs_address: str, ip: str, timeout_s: float = 5.0) -> bool:
    """Whether the GCS at `gcs_address` lists an alive node at `ip` (False when it does not answer)."""
    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient
    try:
        gcs = GcsClient(address=canonicalize_bootstrap_address(gcs_address))
        return any(n.state == 0 and n.node_manager_address == ip
                   for n in gcs.get_all_node_info(timeout=timeout_s).values())
    except Exception as exc:  # unreachable, refused, another cluster's id: not alive, as far as we can tell
        logger.debug("GCS at %s: %s", gcs_address, exc)
        return False


def exit_gracefully() -> None:
    """SIGTERM to this process: the same path as a pod's termination."""
    os.kill(os.getpid(), signal.SIGTERM)


class RayMembershipWatch:
    def __init__(self, alive: Callable[[], bool], on_lost: Callable[[], None] = exit_gracefully,
                 interval_s: float = 5.0, grace_s: float = 45.0, what: str = "this process"):
        self.alive, self.on_lost, self.interval_s, self.grace_s, self.what = alive, on_lost, interval_s, grace_s, what
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ray-membership-watch")

    @classmethod
    def of_this_process(cls, what: str, **kw) -> RayMembershipWatch:
        """Watching the GCS this (connected) driver joined, for a node at this host's address."""
        import ray
        from cluster.ranks import nodes
        gcs_address, ip = ray.get_runtime_context().gcs_address, nodes.node_address(loopback=False)
        return cls(lambda: node_alive_at(gcs_address, ip), what=what, **kw)

    def start(self) -> RayMembershipWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        absent_since = None
        while not self._stop.wait(self.interval_s):
            if self.alive():
                absent_since = None
                continue
            absent_since = absent_since or time.monotonic()
            if time.monotonic() - absent_since >= self.grace_s:
                logger.error("%s's Ray node has not been alive in its Ray cluster for %.0f s (the Ray head "
                             "restarted?): exiting, to be started again and join the cluster there is now",
                             self.what, time.monotonic() - absent_since)
                self.lost = True
                self.on_lost()
                return
