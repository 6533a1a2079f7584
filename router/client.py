"""The router's door to an instance. `cluster` supplies implementations (Ray actors, or
in-process workers in tests); the router never imports Ray."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.core.request import RequestMessage
from kvtransfer.params import KVEndpoint, KVTransferParams, Reservation


class InstanceDeadError(RuntimeError):
    """The instance (one of its ranks) is gone; its requests must finish elsewhere."""

    def __init__(self, instance_id: str, reason: str = ""):
        super().__init__(f"instance {instance_id} is dead: {reason}")
        self.instance_id = instance_id


@dataclass(frozen=True)
class InstanceLoad:
    """An instance's load as its rank 0 last reported it (`load()`), typed: what placement, the
    autoscaler and a drain read by name. `figures` keeps every figure reported, counters included
    (the metrics export them by name: gateway/metrics.py)."""
    running: float = 0.0  # sequences in the running batch
    waiting: float = 0.0  # requests waiting to be scheduled
    reserved: float = 0.0  # decode: requests whose KV is still arriving
    queued_prefill_tokens: float = 0.0  # prefill: prompt tokens not yet computed
    kv_usage: float = 0.0  # fraction of KV blocks in use
    figures: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, figures: Mapping[str, float]) -> InstanceLoad:
        named = {k: float(figures.get(k, 0.0)) for k in ("running", "waiting", "reserved", "queued_prefill_tokens",
                                                         "kv_usage")}
        return cls(**named, figures={str(k): float(v) for k, v in figures.items()})

    @property
    def idle(self) -> bool:
        """Nothing runs, waits, arrives or is queued there."""
        return not (self.running or self.waiting or self.reserved or self.queued_prefill_tokens)


@dataclass
class InstanceInfo:
    instance_id: str
    role: str  # "prefill" | "decode" | "colocated"
    tp_size: int
    kv_endpoints: tuple[KVEndpoint, ...] = ()  # one per rank: a decode's, a prefill's (its fetches)
    load: InstanceLoad = field(default_factory=InstanceLoad)  # as last read (router or controller)
    healthy: bool = True
    draining: bool = False  # being taken out: no new requests, running ones finish
    max_model_len: int = 0  # longest sequence (prompt + output) the instance can hold
    block_size: int = 0  # tokens per KV block its engine uses (the attention backend may round the spec's); 0: unknown
    engine: dict[str, str] = field(default_factory=dict)  # what its engine chose at load (RankHost.engine); {}: unknown


class PrefillClient(ABC):
    info: InstanceInfo

    @abstractmethod
    def submit(self, msg: RequestMessage, params: KVTransferParams) -> None:
        """Queue a prompt for prefill; its KV goes to `params.endpoints`."""

    @abstractmethod
    def poll_outputs(self, timeout: float, client_id: str = "") -> list:
        """PrefillResults (first token or error) of `client_id`'s requests since its last call;
        long-polls up to `timeout`. A client that stops polling has its requests aborted."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def load(self) -> dict[str, float]: ...

    def fetch(self, msg: RequestMessage, params: KVTransferParams, num_tokens: int, holder_tp: int) -> int | None:
        """As `submit`, the KV of the prompt's first `num_tokens` tokens to come from another
        instance's `ship_held` (`holder_tp` ranks): returns once every rank expects it, the first
        token the holder must ship from; None when the instance fetches nothing for it (it then
        computes the prompt as submitted). A client that cannot fetch submits: None."""
        self.submit(msg, params)
        return None

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> str | None:
        """Ships the KV of `token_ids` (whole blocks its prefix cache holds) from
        `params.decode_cached_tokens` on to `params.endpoints`, computing nothing. Returns once they
        are held: None (on their way), or why nothing is shipped."""
        return f"{type(self).__name__} ships no held KV"

    def give_up_fetch(self, request_id: str) -> None:
        """The holder will not ship `request_id`'s KV: the instance computes it."""

    def expert_counts(self) -> dict[int, list[int]]:
        """A mixture of experts: per sparse layer, the tokens routed to each expert since start, for
        /status and `pdserve expert-plan`; {} for a dense model or a client that cannot ask."""
        return {}

    def kv_events(self, since: int) -> dict | None:
        """What the instance's prefix cache stored and evicted after event `since`, or a snapshot
        (engine/core/kv_events.py); None for a client that cannot ask (a prefix index then knows
        nothing of the instance)."""
        return None


class DecodeClient(ABC):
    info: InstanceInfo

    def kv_events(self, since: int) -> dict | None:
        """As PrefillClient.kv_events: what the instance's prefix cache holds (a delta transfer ships
        the rest; a colocated instance computes the rest)."""
        return None

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> str | None:
        """As PrefillClient.ship_held, from the blocks its pool holds (a conversation's outputs too)."""
        return f"{type(self).__name__} ships no held KV"

    @abstractmethod
    def reserve(self, msg: RequestMessage, prefill_tp: int) -> Reservation | None:
        """Reserve KV blocks for `msg`'s prompt (admission control); None if they don't fit now. The
        reservation says how much of the prompt the instance's prefix cache holds: not shipped."""

    @abstractmethod
    def add_request(self, msg: RequestMessage) -> bool:
        """Prefill and decode here (colocated, or conditional disaggregation's short prompts); False
        when its priority class has no seat there now (admission control: the router keeps it)."""

    @abstractmethod
    def poll_outputs(self, timeout: float, client_id: str = "") -> list:
        """RequestOutputs of `client_id`'s requests on the instance since its last call (long
        poll). A client that stops polling has its requests aborted."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def load(self) -> dict[str, float]: ...

    def expert_counts(self) -> dict[int, list[int]]:
        """A mixture of experts: per sparse layer, the tokens routed to each expert since start, for
        /status and `pdserve expert-plan`; {} for a dense model or a client that cannot ask."""
        return {}
