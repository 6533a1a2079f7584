"""Router clients for instances: in-process (`Local*`, for tests and single-process use) and
Ray actors (`Ray*`). A Ray call to a dead actor becomes InstanceDeadError."""
from __future__ import annotations

from router.client import DecodeClient, InstanceDeadError, InstanceInfo, PrefillClient


class LocalPrefillClient(PrefillClient):
    def __init__(self, info: InstanceInfo, worker):
        self.info, self.worker = info, worker

    def submit(self, req, params):
        self.worker.submit(req, params)

    def poll_results(self, timeout):
        return self.worker.poll_results(timeout)

    def abort(self, request_id):
        self.worker.abort(request_id)

    def load(self):
        return self.worker.load()


class LocalDecodeClient(DecodeClient):
    def __init__(self, info: InstanceInfo, worker):
        self.info, self.worker = info, worker

    def reserve(self, req, prefill_tp):
        return self.worker.reserve(req, prefill_tp)

    def add_request(self, request_id, prompt_token_ids, params):
        self.worker.add_request(request_id, prompt_token_ids, params)

    def get_outputs(self, timeout):
        return self.worker.get_outputs(timeout)

    def abort(self, request_id):
        self.worker.abort(request_id)

    def load(self):
        return self.worker.load()


class _RayClient:
    call_timeout_s = 60.0

    def __init__(self, info: InstanceInfo, actor):
        self.info, self.actor = info, actor

    def _call(self, method: str, *args, timeout: float | None = None):
        import ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout or self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise InstanceDeadError(self.info.instance_id, type(exc).__name__) from exc


class RayPrefillClient(_RayClient, PrefillClient):
    def submit(self, req, params):
        self._call("submit", req, params)

    def poll_results(self, timeout):
        return self._call("poll_results", timeout, timeout=timeout + self.call_timeout_s)

    def abort(self, request_id):
        self._call("abort", request_id)

    def load(self):
        return self._call("load")


class RayDecodeClient(_RayClient, DecodeClient):
    def reserve(self, req, prefill_tp):
        return self._call("reserve", req, prefill_tp)

    def add_request(self, request_id, prompt_token_ids, params):
        self._call("add_request", request_id, prompt_token_ids, params)

    def get_outputs(self, timeout):
        return self._call("get_outputs", timeout, timeout=timeout + self.call_timeout_s)

    def abort(self, request_id):
        self._call("abort", request_id)

    def load(self):
        return self._call("load")
