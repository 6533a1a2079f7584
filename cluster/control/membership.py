"""What the controller tells a router in its own process about the instances it owns
(cluster/control/cluster.py wires one; `pdserve controller` has none: its gateways read the cluster
state instead). Each callback does nothing unless given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.control.instance import Instance


def _nothing(*args) -> None:
    return None


@dataclass(frozen=True)
class Membership:
    started: Callable[[], None] = _nothing  # every initial instance is up
    added: Callable[[Instance], None] = _nothing  # an instance joined while serving
    draining: Callable[[str], None] = _nothing  # no new requests may go to the instance
    removed: Callable[[str], None] = _nothing  # it is leaving: what still runs there is retried elsewhere
    lost: Callable[[str, Exception], None] = _nothing  # it stopped answering: its requests are retried elsewhere
    stopping: Callable[[], None] = _nothing  # before the instances stop
    busy: Callable[[str], bool] = lambda instance_id: False  # requests still need the instance
