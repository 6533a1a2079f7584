"""Router clients for instances: in-process (`Local*`, for tests and single-process use) and
Ray actors (`Ray*`). A Ray call to a dead actor, or one that does not answer within the liveness
deadline (`liveness_s`, the spec's heartbeat TTL: a host whose link was cut answers nothing),
becomes InstanceDeadError. Aborts are sent without waiting for an answer."""
from __future__ import annotations

from router.client import DecodeClient, InstanceDeadError, InstanceInfo, PrefillClient


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


class LocalPrefillClient(_LocalClient, PrefillClient):
    def submit(self, msg, params):
        self.worker.submit(msg, params)


class LocalDecodeClient(_LocalClient, DecodeClient):
    def reserve(self, msg, prefill_tp):
        return self.worker.reserve(msg, prefill_tp)

    def add_request(self, msg):
        self.worker.add_request(msg)


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


class RayPrefillClient(_RayClient, PrefillClient):
    def submit(self, msg, params):
        self._call("submit", msg, params)

    def poll_outputs(self, timeout, client_id=""):
        return self._call("poll_outputs", timeout, client_id, wait_s=timeout)

    def load(self):
        return self._call("load")


class RayDecodeClient(_RayClient, DecodeClient):
    def reserve(self, msg, prefill_tp):
        return self._call("reserve", msg, prefill_tp)

    def add_request(self, msg):
        self._call("add_request", msg)

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
