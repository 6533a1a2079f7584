"""The KV transports by the spec's `kv_transport` names (base.py's interface). Adding one is new
files in kvtransfer/ and an entry here (with its name in cluster/spec.py's KV_TRANSPORTS, which
`spec_registry` holds this to). The name reaches `create_kv_transport` through the rank
(cluster/ranks/rank.py). "auto" is torch.distributed with same-device writes where a prefill and a
decode rank share a GPU (cluster/control/rank_planner.py decides those); "torch" the same transport,
always over its data channel; "nixl" the decode rank reading the prefill's pool over NIXL
(nixl_transport.py; the optional extra `pdserve[nixl]`)."""
from __future__ import annotations

from cluster.spec import spec_registry
from kvtransfer.base import KVTransport
from kvtransfer.nixl_agent import nixl_unavailable
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.torch_dist import TorchDistTransport

TRANSPORTS = spec_registry("kv_transport", {"auto": TorchDistTransport, "torch": TorchDistTransport,
                                            "nixl": NixlTransport})
UNAVAILABLE = {"nixl": nixl_unavailable}  # transports that need an optional package: why not, or None
DEFAULT = "auto"


def create_kv_transport(name: str = DEFAULT) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    if name in UNAVAILABLE and (why := UNAVAILABLE[name]()) is not None:
        raise ValueError(why)
    return TRANSPORTS[name]()


def transport_unavailable(name: str) -> str | None:
    """Why KV transport `name` cannot run here (None: it can, or it is unknown: spec checks that)."""
    return UNAVAILABLE[name]() if name in UNAVAILABLE else None
