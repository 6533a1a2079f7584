"""The KV transports by the spec's `kv_transport` names (base.py's interface). Adding one is new
files in kvtransfer/ and an entry here (with its name in cluster/spec.py's KV_TRANSPORTS, which
`spec_registry` holds this to). The name reaches `create_kv_transport` through the rank
(cluster/ranks/rank.py). "auto" is torch.distributed with same-device writes where a prefill and a
decode rank share a GPU (cluster/control/rank_planner.py decides those); "torch" the same transport,
always over its data channel."""
from __future__ import annotations

from cluster.spec import spec_registry
from kvtransfer.base import KVTransport
from kvtransfer.torch_dist import TorchDistTransport

TRANSPORTS = spec_registry("kv_transport", {"auto": TorchDistTransport, "torch": TorchDistTransport})
DEFAULT = "auto"


def create_kv_transport(name: str = DEFAULT) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]()
