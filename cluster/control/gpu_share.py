"""How a cluster's ranks use the Ray cluster's GPUs (issue 13): each rank's Ray `num_gpus` and each
role's `gpu_memory_utilization`, so that the default cluster (1 prefill + 1 decode, tp=1) runs on
one GPU.

    ranks <= GPUs   a GPU per rank: num_gpus 1.0, gpu_memory_utilization = the role's key
                    (prefill_/decode_gpu_memory_utilization), else gpu_memory_utilization
    ranks >  GPUs   shared: one GPU holds a group of ceil(ranks of the role / GPUs) ranks per role;
                    gpu_memory_utilization (the budget of the whole GPU) is split among the group,
                    a decode rank getting twice a prefill rank's share (it holds the KV of every
                    running sequence), unless the role's key sets it; each rank's num_gpus is its
                    share of the group's memory, so whatever ranks Ray packs on one GPU (their
                    num_gpus add up to <= 1) fit in that GPU's memory.

    1P1D on 1 GPU, budget 0.9:  num_gpus prefill 0.3333 decode 0.6666, memory prefill 0.30 decode 0.60

Refused before any instance starts (ValueError, one line): a tensor-parallel instance on shared GPUs
(Ray places the fractional-GPU bundles of one placement group on one device: best fit; NCCL refuses
two ranks on one device), and shares that add up to more than one GPU.

Pure functions over the spec; no Ray. Decisions: docs/multihost.md ("Sharing a GPU").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.spec import ClusterSpec

# A rank's share of a shared GPU's memory, relative to the others in its group.
ROLE_WEIGHT = {"prefill": 1, "decode": 2, "colocated": 2}
GPU_UNIT = 10_000  # Ray counts resources in 1/10000 (and truncates finer fractions)


@dataclass(frozen=True)
class RoleShare:
    """What one rank of a role gets."""
    num_gpus: float  # Ray's GPU request of the rank (and of its placement group bundle)
    gpu_memory_utilization: float  # fraction of its GPU's memory the rank may use (engine CacheConfig)
    ranks_per_gpu: int  # ranks of the role in one GPU's group (1 when not shared)


@dataclass(frozen=True)
class GpuPlan:
    """How the ranks of a spec use `num_gpus` GPUs (`gpu_plan` builds it)."""
    num_gpus: int  # GPUs of the Ray cluster
    num_ranks: int  # ranks of the spec's instances, all roles
    roles: dict[str, RoleShare]  # role -> its share

    def __post_init__(self):
        if self.shared:  # what one GPU's group asks of Ray and of the memory fits in one GPU
            assert sum(s.num_gpus * s.ranks_per_gpu for s in self.roles.values()) <= 1 + 1e-9, self
            assert sum(s.gpu_memory_utilization * s.ranks_per_gpu for s in self.roles.values()) <= 1 + 1e-9, self

    @property
    def shared(self) -> bool:
        """Ranks share GPUs (there are fewer GPUs than ranks, and at least one)."""
        return 0 < self.num_gpus < self.num_ranks

    @property
    def start_order(self) -> tuple[str, ...]:
        """Roles in the order their instances start: the largest GPU share first when shared.
        Ray gives a fractional request the GPU it fits best; placing the large requests (decode)
        before the small ones (prefill, the unit of the split) never leaves a gap too small for
        a decode rank, while prefill first can (2 prefill + 4 decode on 2 GPUs: both prefill on
        one GPU, and the fourth decode finds 0.2 free on each)."""
        if not self.shared:
            return tuple(self.roles)
        return tuple(sorted(self.roles, key=lambda r: -self.roles[r].num_gpus))

    def describe(self) -> str:
        """One line for the log: which mode runs, with each role's num_gpus and memory share."""
        memory = " ".join(f"{r} {s.gpu_memory_utilization:.2f}" for r, s in self.roles.items())
        gpus = _gpus(self.num_gpus)
        if not self.shared:
            return f"{self.num_ranks} ranks on {gpus}: a GPU each (num_gpus 1.0), gpu_memory_utilization {memory}"
        group = " + ".join(f"{s.ranks_per_gpu} {r}" for r, s in self.roles.items())
        num_gpus = " ".join(f"{r} {s.num_gpus:.4g}" for r, s in self.roles.items())
        first = f", {self.start_order[0]} first" if len(self.roles) > 1 else ""
        return (f"{self.num_ranks} ranks share {gpus} ({group} per GPU): num_gpus {num_gpus}, "
                f"gpu_memory_utilization {memory}; instances start one at a time{first}")


def memory_key(role: str) -> str:
    """The spec key of a role's own gpu_memory_utilization (colocated instances use decode's)."""
    return "prefill_gpu_memory_utilization" if role == "prefill" else "decode_gpu_memory_utilization"


def tp_key(role: str) -> str:
    """The spec key of a role's TP size (colocated instances use decode's)."""
    return "prefill_tp" if role == "prefill" else "decode_tp"


def gpu_plan(spec: ClusterSpec, num_gpus: int) -> GpuPlan:
    """Each role's share of the GPUs for the instances of `spec` (`instance_counts`, `tp_size`).

    Args:
        spec: the cluster spec; its gpu_memory_utilization is the budget of a GPU, split among
            the ranks sharing it, and its per-role keys override a role's part.
        num_gpus: GPUs of the Ray cluster. Below 1: a GPU per rank is planned anyway (placement
            then says that no node has a GPU).
    Returns:
        A GpuPlan; `shared` when there are fewer GPUs than ranks.
    Raises:
        ValueError (one line naming the keys): a tp > 1 instance on shared GPUs; shares of one
        GPU that add up to more than 1.
    """
    ranks = {role: n * spec.tp_size(role) for role, n in spec.instance_counts.items()}
    num_ranks = sum(ranks.values())
    if not 0 < num_gpus < num_ranks:
        roles = {r: RoleShare(1.0, _own_or(spec, r, spec.gpu_memory_utilization), 1) for r in ranks}
        return GpuPlan(num_gpus, num_ranks, roles)
    _check_no_tp(spec, ranks, num_gpus)
    group = {role: math.ceil(n / num_gpus) for role, n in ranks.items()}
    weights = sum(ROLE_WEIGHT[r] * k for r, k in group.items())
    memory = {r: _own_or(spec, r, spec.gpu_memory_utilization * ROLE_WEIGHT[r] / weights) for r in group}
    used = sum(memory[r] * k for r, k in group.items())
    if used > 1 + 1e-9:
        raise ValueError(_over_one_gpu(spec, group, memory, used, f"{num_ranks} ranks on {_gpus(num_gpus)}"))
    roles = {r: RoleShare(_ray_fraction(memory[r] / used), memory[r], k) for r, k in group.items()}
    return GpuPlan(num_gpus, num_ranks, roles)


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def _own_or(spec: ClusterSpec, role: str, derived: float) -> float:
    own = spec.role_gpu_memory_utilization(role)
    return derived if own is None else own


def _ray_fraction(share: float) -> float:
    """`share` rounded down to Ray's resource unit, so that the group's requests add up to <= 1."""
    return max(1, math.floor(share * GPU_UNIT + 1e-6)) / GPU_UNIT


def _check_no_tp(spec: ClusterSpec, ranks: dict[str, int], num_gpus: int) -> None:
    """Each rank of a TP group needs a device of its own: NCCL refuses two ranks on one device, and
    Ray gives the fractional-GPU bundles of one placement group one device (the best fit)."""
    tp = {tp_key(r): spec.tp_size(r) for r in ranks if spec.tp_size(r) > 1}
    if tp:
        named = ", ".join(f"{k}={v}" for k, v in tp.items())
        raise ValueError(f"{named}: {sum(ranks.values())} ranks would share {_gpus(num_gpus)}, and the ranks of a "
                         f"tensor-parallel instance cannot share a GPU (NCCL refuses two ranks on one device); "
                         f"set {' and '.join(f'{k}=1' for k in tp)}, or give each rank a GPU")


def _over_one_gpu(spec: ClusterSpec, group: dict[str, int], memory: dict[str, float], used: float,
                  where: str) -> str:
    keys = " and ".join(dict.fromkeys(memory_key(r) for r in group))
    derived = {r: " (derived)" if spec.role_gpu_memory_utilization(r) is None else "" for r in group}
    terms = " + ".join(f"{k} {r} x {memory[r]:.2f}{derived[r]}" for r, k in group.items())
    return f"{keys}: the ranks sharing one GPU ({where}) would use {terms} = {used:.2f} of its memory, " \
           f"more than 1; lower {keys}"
