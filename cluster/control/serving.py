"""What a gateway serves through, and the router's clients of instances.

`Serving` (gateway/app.py): a router over instances, whoever owns them: the
controller in this process (cluster/control/cluster.py) or one elsewhere (cluster/control/frontend.py).

The clients: router clients for instances: in-process (`Local*`, for tests and single-process use) and
Ray actors (`Ray*`). A Ray call to a dead actor, or one that does not answer within the liveness
deadline (`liveness_s`, the spec's heartbeat TTL: a host whose link was cut answers nothing),
becomes InstanceDeadError. Aborts are sent without waiting for an answer."""
from __future__ import annotations

import time

from cluster.control.expert_counts import ExpertCountCache
from cluster.control.instance import Instance
from cluster.spec import ClusterSpec
from cluster.state import ClusterState
from engine.core.request import SamplingParams
from router.client import DecodeClient, InstanceDeadError, InstanceInfo, PrefillClient
from router.router import Router
from router.tables import RequestStream


class Serving:
    """What the gateway app calls on a cluster: a router (once started) over instances; readers get
    typed snapshots of them (router/view.py ClusterView)."""

    def __init__(self, spec: ClusterSpec, instances: dict[str, Instance], state: ClusterState):
        self.spec, self.instances, self.state = spec, instances, state  # instances: the owner's table, shared
        self.router: Router | None = None
        self._expert_counts = ExpertCountCache()

    # -- the view (router/view.py) ---------------------------------------------------------------
    def instance_infos(self) -> list[InstanceInfo]:
        return [i.info() for i in list(self.instances.values())]

    def instance_status(self) -> list[dict]:
        """/status rows, each with the instance's expert counts (asked at most every few seconds)."""
        instances = list(self.instances.values())
        counts = self._expert_counts.get(instances)
        return [{**i.status(), "expert_counts": c} for i, c in zip(instances, counts)]

    def router_stats(self) -> dict[str, dict[str, float]]:
        """As published in the cluster state, with this process' router's counters as they are now."""
        own = {self.router.client_id: self.router.snapshot()} if self.router is not None else {}
        return {**self.state.router_stats(), **own}

    # -- requests --------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, listener=None,
               session: str | None = None, trace: str = "", tenant: str = "", weight: float = 1.0) -> RequestStream:
        return self.router.submit(request_id, prompt_token_ids, params, listener, session, trace, tenant, weight)

    def abort(self, request_id: str) -> None:
        """Stop a request on every instance it touches; its blocks are freed."""
        self.router.abort(request_id)

    def stop(self, request_id: str, index: int, num_tokens: int) -> None:
        """The gateway found a stop string in choice `index`, completed by its token `num_tokens`."""
        self.router.stop(request_id, index, num_tokens)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output every instance holds (0 while none is known)."""
        lens = [i.client.info.max_model_len for i in list(self.instances.values())]
        return min(lens) if lens else 0

    def ready(self) -> bool:
        """At least one healthy decode instance and, when disaggregated, one healthy prefill."""
        infos = [i.client.info for i in list(self.instances.values()) if i.client.info.healthy]
        has = lambda *roles: any(i.role in roles for i in infos)  # noqa: E731
        return self.router is not None and has("decode", "colocated") and (self.spec.mode == "colocated"
                                                                           or has("prefill"))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 timeout_s: float | None = 600.0) -> list[RequestStream]:
        """All prompts at once through the router; returns their finished streams in order (a prompt
        with n > 1 gives its n choices' in a row)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        streams = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            got = self.submit(f"gen-{time.monotonic_ns()}-{i}", p, sp)
            streams += got if isinstance(got, list) else [got]
        return [s.result(timeout=timeout_s) for s in streams]


class _LocalClient:
    """What both in-process clients do: hand the call to the worker."""

    def __init__(self, info: InstanceInfo, worker):
        self.info, self.worker = info, worker

    def poll_outputs(self, timeout, client_id=""):
        return self.worker.poll_outputs(timeout, client_id)

    def abort(self, request_id):
        self.worker.abort(request_id)

    def load(self):
        return self.worker.load()

    def expert_counts(self):
        return self.worker.expert_counts()

    def kv_events(self, since):
        return self.worker.kv_events(since)

    def ship_held(self, request_id, token_ids, params):
        return self.worker.ship_held(request_id, token_ids, params)


class LocalPrefillClient(_LocalClient, PrefillClient):
    def submit(self, msg, params):
        self.worker.submit(msg, params)

    def fetch(self, msg, params, num_tokens, holder_tp):
        return self.worker.fetch(msg, params, num_tokens, holder_tp)

    def give_up_fetch(self, request_id):
        self.worker.give_up_fetch(request_id)


class LocalDecodeClient(_LocalClient, DecodeClient):
    def reserve(self, msg, prefill_tp):
        return self.worker.reserve(msg, prefill_tp)

    def add_request(self, msg):
        return self.worker.add_request(msg)


FETCH_WAIT_S = 30.0  # how long a fetch or ship_held call may wait for the instance to take it


class _RayClient:
    def __init__(self, info: InstanceInfo, actor, liveness_s: float = 60.0):
        self.info, self.actor, self.liveness_s = info, actor, liveness_s

    def _call(self, method: str, *args, wait_s: float = 0.0):
        """The actor's answer; an actor that is dead, or silent for `wait_s` (the time the call
        itself may take) + `liveness_s`, raises InstanceDeadError."""
        import ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=wait_s + self.liveness_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise InstanceDeadError(self.info.instance_id, type(exc).__name__) from exc

    def abort(self, request_id):
        self.actor.abort.remote(request_id)  # fire and forget: a dead instance has nothing to abort

    def expert_counts(self):
        return self._call("expert_counts")

    def kv_events(self, since):
        return self._call("kv_events", since)

    def ship_held(self, request_id, token_ids, params):
        return self._call("ship_held", request_id, token_ids, params, wait_s=FETCH_WAIT_S)


class RayPrefillClient(_RayClient, PrefillClient):
    def submit(self, msg, params):
        self._call("submit", msg, params)

    def fetch(self, msg, params, num_tokens, holder_tp):
        return self._call("fetch", msg, params, num_tokens, holder_tp, wait_s=FETCH_WAIT_S)

    def give_up_fetch(self, request_id):
        self.actor.give_up_fetch.remote(request_id)  # fire and forget, as an abort

    def poll_outputs(self, timeout, client_id=""):
        return self._call("poll_outputs", timeout, client_id, wait_s=timeout)

    def load(self):
        return self._call("load")


class RayDecodeClient(_RayClient, DecodeClient):
    def reserve(self, msg, prefill_tp):
        return self._call("reserve", msg, prefill_tp)

    def add_request(self, msg):
        return self._call("add_request", msg)

    def poll_outputs(self, timeout, client_id=""):
        return self._call("poll_outputs", timeout, client_id, wait_s=timeout)

    def load(self):
        return self._call("load")


# a role's client (cluster/ranks/roles.py: a colocated instance takes requests as a decode one does)
LOCAL_CLIENTS = {"prefill": LocalPrefillClient, "decode": LocalDecodeClient, "colocated": LocalDecodeClient}
RAY_CLIENTS = {"prefill": RayPrefillClient, "decode": RayDecodeClient, "colocated": RayDecodeClient}


def local_client(info: InstanceInfo, worker) -> PrefillClient | DecodeClient:
    return LOCAL_CLIENTS[info.role](info, worker)


def ray_client(info: InstanceInfo, actor, liveness_s: float) -> PrefillClient | DecodeClient:
    return RAY_CLIENTS[info.role](info, actor, liveness_s)
