"""Each instance's expert counts for /status, asked of it at most once per `ttl_s` however often
/status is read (it used to be one Ray call per instance per read)."""
from __future__ import annotations

import time

from cluster.control.instance import Instance
from router.client import InstanceDeadError


class ExpertCountCache:
    def __init__(self, ttl_s: float = 5.0):
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, dict | None]] = {}  # instance id -> (asked at, counts)

    def get(self, instances: list[Instance]) -> list[dict[str, list[int]] | None]:
        now, ids = time.monotonic(), {i.instance_id for i in instances}
        self._seen = {iid: seen for iid, seen in self._seen.items() if iid in ids}  # gone: forgotten
        for i in instances:
            if i.instance_id not in self._seen or now - self._seen[i.instance_id][0] >= self.ttl_s:
                self._seen[i.instance_id] = (now, _expert_counts(i))
        return [self._seen[i.instance_id][1] for i in instances]


def _expert_counts(instance: Instance) -> dict[str, list[int]] | None:
    """A mixture's tokens per expert per sparse layer ({}: dense), asked of the instance; None when
    it does not answer (a dead one: /status still shows the rest)."""
    try:
        return {str(layer): counts for layer, counts in instance.client.expert_counts().items()}
    except InstanceDeadError:
        return None
