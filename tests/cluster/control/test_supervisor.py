"""The controller's supervisor outlives faults of the cluster state: a Redis that times out while
a dead instance is being recorded (its link cut or slowed) fails that call, not the thread, and
the pool is back at its size. The chaos run found this: the thread died on a redis TimeoutError in
`_destroy`, and no instance was ever replaced again."""
from __future__ import annotations

import time

import pytest
import redis

from cluster.control.controller import Controller
from cluster.state import MemoryState
from tests.cluster.control.test_ray_cluster import spec_for

pytestmark = pytest.mark.timeout(300)


class FlakyState(MemoryState):
    """A MemoryState whose writes about a dead instance time out `failures` times, as redis-py does
    when the store's link is cut mid-call."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    def set_health(self, instance_id: str, health: str) -> None:
        if self.failures > 0 and health == "dead":
            self.failures -= 1
            raise redis.exceptions.TimeoutError(f"Timeout reading from redis (marking {instance_id} dead)")
        super().set_health(instance_id, health)


def wait_replaced(controller, old: str, role: str, timeout_s: float = 60.0) -> None:
    """Until an instance of `role` other than `old` is up (`timeout_s`: a failure naming them)."""
    deadline = time.monotonic() + timeout_s
    while not any(i != old and inst.role == role for i, inst in controller.instances.items()):
        assert time.monotonic() < deadline, f"{old} never replaced: {list(controller.instances)}"
        time.sleep(0.1)


def test_supervisor_survives_a_state_store_timeout_and_replaces_the_dead(tiny_path):
    """An instance lost while the store times out is still replaced, a second one later too, the
    supervising thread stays alive, and the fault is counted."""
    state = FlakyState(failures=1)
    spec = spec_for(tiny_path, num_prefill=1, num_decode=1, heartbeat_ttl_s=0.6)
    with Controller(spec, state=state, use_ray=False) as controller:
        for _ in range(2):
            (old,) = [i for i, inst in controller.instances.items() if inst.role == "decode"]
            controller.mark_lost(old, RuntimeError("lost (test)"))
            wait_replaced(controller, old, "decode")
        assert all(t.is_alive() for t in controller._threads)
        assert controller.supervise_errors == 0 and state.failures == 0
        assert {inst.role for inst in controller.instances.values()} == {"prefill", "decode"}


def test_a_fault_inside_the_supervisor_is_counted_and_the_loop_goes_on(tiny_path, monkeypatch):
    """Whatever raises inside one round of supervision (here: its first replacement) is logged and
    counted (pdserve_controller_supervise_errors_total), and the next round replaces the instance."""
    spec = spec_for(tiny_path, num_prefill=1, num_decode=1, heartbeat_ttl_s=0.6)
    with Controller(spec, state=MemoryState(), use_ray=False) as controller:
        real, calls = controller._replace_dead, []

        def flaky(owed):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected (test)")
            real(owed)
        monkeypatch.setattr(controller, "_replace_dead", flaky)
        (old,) = [i for i, inst in controller.instances.items() if inst.role == "decode"]
        controller.mark_lost(old, RuntimeError("lost (test)"))
        wait_replaced(controller, old, "decode")
        assert controller.supervise_errors == 1 and all(t.is_alive() for t in controller._threads)


def test_an_in_process_rank_whose_loop_dies_is_lost_and_replaced(tiny_path):
    """A step that raises kills an in-process prefill rank's loop (a Ray rank's process exits
    instead): the instance is lost at once, so the request in it ends (retried on the replacement,
    or with an explicit error) instead of waiting forever, and the pool is back at its size."""
    from cluster.control.cluster import Cluster
    from engine.core.request import SamplingParams
    from tests.helpers import random_prompts
    spec = spec_for(tiny_path, num_prefill=1, num_decode=1, heartbeat_ttl_s=0.6)
    with Cluster(spec, use_ray=False) as cluster:
        (old,) = [i for i, inst in cluster.instances.items() if inst.role == "prefill"]
        worker = cluster.instances[old].ranks[0].worker

        def step():
            raise ValueError("injected (test): a request the sampler cannot take")
        worker.step = step
        (stream,) = cluster.generate(random_prompts(1, [12], seed=1), SamplingParams(max_tokens=4), timeout_s=120)
        assert stream.error is None or "dead" in stream.error or "died" in stream.error, stream.error
        wait_replaced(cluster, old, "prefill")
