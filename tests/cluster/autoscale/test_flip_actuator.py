"""The RayActuator's flips (cluster/autoscale/actuators.py): a decision that moves capacity from one pool
to the other flips the shrinking pool's least loaded instances; the rest is added or removed; a cluster
that cannot flip gets adds and removes. Against a stand-in cluster that records what it is asked."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cluster.autoscale.actuators import PoolSizes, RayActuator
from router.client import InstanceInfo, InstanceLoad


@dataclass
class Pools:
    infos: dict[str, InstanceInfo] = field(default_factory=dict)
    calls: list = field(default_factory=list)
    refuse: str | None = None  # why flip_instance raises ValueError

    def add(self, iid: str, role: str, running: float = 0.0) -> None:
        self.infos[iid] = InstanceInfo(iid, role, 1, load=InstanceLoad.of({"running": running,
                                                                            "queued_prefill_tokens": running}))

    def instance_infos(self) -> list[InstanceInfo]:
        return list(self.infos.values())

    def flip_instance(self, iid: str, role: str, timeout_s: float) -> dict[str, float]:
        if self.refuse:
            raise ValueError(self.refuse)
        self.calls.append(("flip", iid, role))
        self.infos[iid].role = role
        return {"drain_s": 0.02, "rebuild_s": 0.08, "total_s": 0.1}  # (flip_instance's keys)

    def add_instance(self, role: str) -> str:
        iid = f"{role}-new{len(self.infos)}"
        self.add(iid, role)
        self.calls.append(("add", role))
        return iid

    def drain_instance(self, iid: str, timeout_s: float) -> bool:
        self.calls.append(("drain", iid))
        del self.infos[iid]
        return True


def two_by_two() -> Pools:
    pools = Pools()
    pools.add("prefill-0", "prefill", running=50)
    pools.add("prefill-1", "prefill", running=5)  # the least loaded prefill instance
    pools.add("decode-0", "decode", running=3)
    pools.add("decode-1", "decode", running=9)
    return pools


def test_moving_capacity_between_pools_flips_the_least_loaded():
    pools = two_by_two()
    act = RayActuator(pools)
    act.apply(PoolSizes(1, 3))
    assert pools.calls == [("flip", "prefill-1", "decode")] and act.current() == PoolSizes(1, 3)
    assert act.measured() == {"flip_s": 0.08}  # the rebuild, for the planner (which models the drain)
    act.apply(PoolSizes(2, 3))  # one pool grows alone: an add
    assert set(act.measured()) == {"flip_s", "startup_s"} and act.measured()["startup_s"] >= 0
    act.apply(PoolSizes(3, 1))  # decode shrinks by 2, prefill grows by 1: one flip, one drain
    assert pools.calls[1:] == [("add", "prefill"), ("flip", "decode-0", "prefill"), ("drain", "prefill-1")]
    assert act.current() == PoolSizes(3, 1)


def test_no_flips_when_asked_for_none_or_refused(caplog):
    caplog.set_level(logging.INFO, logger="cluster.autoscale.actuators")
    for act_of in (lambda p: RayActuator(p, flips=False), RayActuator):
        pools = two_by_two()
        if act_of is RayActuator:
            pools.refuse = "a flip is not with speculative decoding on"
        act_of(pools).apply(PoolSizes(1, 3))
        assert pools.calls == [("drain", "prefill-1"), ("add", "decode")]
    assert "no flip (a flip is not with speculative decoding on)" in caplog.text


def test_adds_start_at_once_and_a_failure_is_reported():
    """Three instances for a step of load start together (each waits for the other two here: one
    after the other, the first would wait alone and fail); one add that fails fails the apply, said."""
    import threading

    import pytest

    from cluster.autoscale.actuators import ActuatorError

    pools = two_by_two()
    together = threading.Barrier(3, timeout=10)
    add = pools.add_instance

    def add_together(role):
        together.wait()
        return add(role)

    pools.add_instance = add_together
    act = RayActuator(pools, flips=False)
    act.apply(PoolSizes(2, 5))
    assert act.current() == PoolSizes(2, 5) and len(act.times["startup_s"]) == 3

    def no_room(role):
        raise RuntimeError("no node has room")

    pools.add_instance = no_room
    with pytest.raises(ActuatorError, match="cannot add 2 of 2 decode instances: no node has room"):
        act.apply(PoolSizes(2, 7))
