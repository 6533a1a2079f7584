"""How a rank's process shares its host's CPUs: scheduling priority, the cores it may run on,
OpenMP's wait policy and its intra-op threads (why each: docs/cpu.md).

    usable_cores()        cores this process may use: its affinity, capped by a cgroup CPU quota
    wait_policy_env(p)    the environment a rank's process starts with (OMP_WAIT_POLICY)
    RankCpuPlan           what the controller decides for one rank: niceness, its slot of cores
    slot_cpus(...)        a slot's cores among a node's usable CPUs
    apply(plan)           in the rank's process: every thread's niceness and affinity, set on purpose
    pin_process(cpus)     every thread of this process on `cpus` (the gateway, off the ranks' cores)
    cpu_state(tid, n)     what /status shows of a rank: niceness, cores, threads, wait policy

No torch, no Ray: the rank's actor and the controller use it, the model never does.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.spec import WAIT_POLICIES

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class RankCpuPlan:
    """What one rank's process runs with.

    Attributes:
        niceness: the scheduling priority of every thread of the rank (Ray starts workers at 15).
        slot: which of its node's core slots the rank is pinned to (None: not pinned).
        cpus_per_rank: cores in a slot (with `slot`).
        reserved_cpus: the node's first usable cores, kept for the gateway, router and Ray.
    """
    niceness: int = 0
    slot: int | None = None
    cpus_per_rank: int | None = None
    reserved_cpus: int = 1

    def __post_init__(self):
        assert -20 <= self.niceness <= 19, self.niceness
        assert (self.slot is None) == (self.cpus_per_rank is None), (self.slot, self.cpus_per_rank)


def cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup's CPU quota in cores (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process can keep busy: its CPU affinity, capped by a CPU quota (a pod's limit),
    since threads past the quota are throttled, not run."""
    n = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    return n if quota is None else max(1, min(n, math.ceil(quota)))


def wait_policy_env(policy: str) -> dict[str, str]:
    """The environment a rank's process needs for `policy`: OpenMP reads it once, when torch loads,
    so it is set where the process is created. A value already in the environment is the user's and
    wins; "inherit" adds nothing (libgomp's own: spin a while, then sleep)."""
    if policy not in WAIT_POLICIES:
        raise ValueError(f"omp_wait_policy must be one of {', '.join(WAIT_POLICIES)}; got {policy!r}")
    if policy == "inherit":
        return {}
    if WAIT_POLICY_ENV in os.environ:
        logger.info("%s=%s from the environment (the spec's omp_wait_policy %s not applied)", WAIT_POLICY_ENV,
                    os.environ[WAIT_POLICY_ENV], policy)
        return {WAIT_POLICY_ENV: os.environ[WAIT_POLICY_ENV]}
    return {WAIT_POLICY_ENV: policy.upper()}


def slot_cpus(cpus: list[int], slot: int, per_rank: int, reserved: int) -> list[int]:
    """The cores of `slot`: after the `reserved` first of `cpus`, `per_rank` each. Raises
    ValueError when the node has too few."""
    start = reserved + slot * per_rank
    if start + per_rank > len(cpus):
        raise ValueError(f"cpus_per_rank {per_rank}: slot {slot} needs cores {start}-{start + per_rank - 1} of "
                         f"{len(cpus)} usable ({reserved} reserved), and this node has too few")
    return cpus[start:start + per_rank]


def num_slots(num_cpus: int, per_rank: int, reserved: int) -> int:
    """How many slots of `per_rank` cores a node of `num_cpus` usable cores holds."""
    return max(0, (num_cpus - reserved) // per_rank)


def _thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def set_niceness(niceness: int) -> int:
    """Every thread of this process at `niceness` (threads started later inherit it from their
    creator). Returns the niceness the calling thread has after: a lower value than the current
    one needs CAP_SYS_NICE, and without it the old one stays (logged)."""
    for tid in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            logger.warning("rank priority: nice %d needs CAP_SYS_NICE; threads stay at nice %d", niceness,
                           os.getpriority(os.PRIO_PROCESS, 0))
            break
    return os.getpriority(os.PRIO_PROCESS, 0)


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process on `cpus`; threads started later inherit it."""
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue


def apply(plan: RankCpuPlan) -> None:
    """In the rank's process, before its threads start: its niceness, and its cores when pinned."""
    got = set_niceness(plan.niceness)
    cpus = None
    if plan.slot is not None:
        cpus = slot_cpus(sorted(os.sched_getaffinity(0)), plan.slot, plan.cpus_per_rank, plan.reserved_cpus)
        pin_process(cpus)
    logger.info("rank CPU plan: nice %d (asked %d), %s, %s=%s", got, plan.niceness,
                f"pinned to cores {format_cpus(cpus)}" if cpus else "not pinned",
                WAIT_POLICY_ENV, os.environ.get(WAIT_POLICY_ENV, "unset (libgomp's default)"))


def format_cpus(cpus) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def cpu_state(step_tid: int, intraop_threads: int | None, adapt_threads: bool = False) -> dict:
    """What /status shows of a rank's process: its step thread's niceness and cores, the process's
    threads, the step thread's intra-op threads at start (with adapt_threads a most: the number now
    is the instance's `intraop_threads` load figure) and OpenMP's wait policy."""
    return {"niceness": os.getpriority(os.PRIO_PROCESS, step_tid), "cpus": format_cpus(os.sched_getaffinity(step_tid)),
            "num_threads": len(_thread_ids()), "intraop_threads": intraop_threads, "adapt_threads": adapt_threads,
            "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV, "default")}


class CoreSlots:
    """Which core slots of each node the controller's ranks hold (pinning on: `cpus_per_rank`).
    Not thread-safe: the controller calls it under its lock (cluster/control/rank_planner.py cores_lock)."""

    def __init__(self, cpus_per_rank: int, reserved_cpus: int):
        self.cpus_per_rank, self.reserved_cpus = cpus_per_rank, reserved_cpus
        self._held: dict[str, dict[str, list[int]]] = {}  # node id -> instance id -> slots

    def take(self, node_id: str, num_cpus: int, instance_id: str, num_ranks: int) -> list[int]:
        """`num_ranks` free slots on a node of `num_cpus` usable cores, held for `instance_id`.
        Raises ValueError naming cpus_per_rank when the node has too few left."""
        held = self._held.setdefault(node_id, {})
        used = {s for slots in held.values() for s in slots}
        free = [s for s in range(num_slots(num_cpus, self.cpus_per_rank, self.reserved_cpus)) if s not in used]
        if len(free) < num_ranks:
            raise ValueError(f"cpus_per_rank {self.cpus_per_rank}: {instance_id} needs {num_ranks} slot(s) of "
                             f"{self.cpus_per_rank} cores, and its node has {len(free)} free of {num_cpus} usable "
                             f"cores ({self.reserved_cpus} reserved)")
        held[instance_id] = free[:num_ranks]
        return held[instance_id]

    def hold(self, node_id: str, instance_id: str, slots: list[int]) -> None:
        """Slots an adopted instance's ranks already sit on."""
        self._held.setdefault(node_id, {})[instance_id] = list(slots)

    def release(self, instance_id: str) -> None:
        for held in self._held.values():
            held.pop(instance_id, None)


def check_host_cores(spec) -> None:
    """With Ray started on this host (no ray_address) and ranks pinned: the host has the cores the
    spec's ranks and reserved_cpus need. Raises ValueError naming cpus_per_rank, before anything starts."""
    if spec.cpus_per_rank is None or spec.ray_address is not None:
        return
    ranks = sum(n * spec.tp_size(r) for r, n in spec.instance_counts.items())
    need, have = ranks * spec.cpus_per_rank + spec.reserved_cpus, usable_cores()
    if need > have:
        raise ValueError(f"cpus_per_rank {spec.cpus_per_rank}: {ranks} rank(s) x {spec.cpus_per_rank} cores + "
                         f"{spec.reserved_cpus} reserved_cpus need {need} cores; this host has {have} usable")


def keep_off_ranks(spec) -> None:
    """In a serving process (gateway, router, controller) when the spec pins ranks: every thread
    onto the first `reserved_cpus` cores, the ones no rank slot takes."""
    if spec.cpus_per_rank is None:
        return
    if spec.reserved_cpus == 0:
        logger.warning("reserved_cpus 0: the gateway and router share the ranks' cores")
        return
    cpus = sorted(os.sched_getaffinity(0))[:spec.reserved_cpus]
    pin_process(cpus)
    logger.info("gateway, router and controller on cores %s, off the ranks' (cpus_per_rank %d)", format_cpus(cpus),
                spec.cpus_per_rank)
