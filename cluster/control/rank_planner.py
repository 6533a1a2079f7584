"""What the controller gives each rank it starts: its node's resources, its engine config (GPU
memory share, CPU threads) and how its process shares the host's CPUs (cluster/ranks/cpu_plan.py)."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

from cluster.control import gpu_share
from cluster.ranks import cpu_plan, nodes
from cluster.spec import ClusterSpec

logger = logging.getLogger(__name__)


class RankPlanner:
    """The controller's per-rank decisions for one spec: the GPU plan (worked out once) and each
    node's pinned cores (with cpus_per_rank), held by the instance they were given to."""

    def __init__(self, spec: ClusterSpec, multihost: bool):
        self.spec, self.multihost = spec, multihost
        self.plan: gpu_share.GpuPlan | None = None  # how ranks use the GPUs (on GPU, once Ray is up)
        self.core_slots = (cpu_plan.CoreSlots(spec.cpus_per_rank, spec.reserved_cpus)
                           if spec.cpus_per_rank is not None else None)  # each node's pinned cores
        self.cores_lock = threading.Lock()  # instances start at once (cluster/control/ray_start.py)

    def gpu_plan(self) -> gpu_share.GpuPlan:
        """How the ranks use the Ray cluster's GPUs (all nodes'), worked out once: in `start`,
        before any instance. The cluster's total, not a node's: a spec whose ranks each had a GPU
        keeps them, and Ray's accounting of the fractions keeps any node's ranks within its GPUs."""
        if self.plan is None:
            import ray
            self.plan = gpu_share.gpu_plan(self.spec, int(ray.cluster_resources().get("GPU", 0)))
            logger.info("%s", self.plan.describe())
        return self.plan

    def rank_resources(self, role: str, gpu: bool) -> dict[str, float]:
        """What one rank of `role` asks of its node (its placement group bundle and its actor)."""
        num_gpus = self.gpu_plan().roles[role].num_gpus if gpu else 0.0
        return nodes.rank_resources(role, gpu, self.spec.ray_resources, num_gpus, self.spec.worker_pods == "shared")

    def role_engine_config(self, role: str, gpu: bool):
        """The spec's engine config of `role`; on GPU with the plan's gpu_memory_utilization."""
        config = self.spec.engine_config(role)
        if not gpu:
            return config
        share = self.gpu_plan().roles[role].gpu_memory_utilization
        return replace(config, cache=replace(config.cache, gpu_memory_utilization=share))

    def engine_config(self, role: str, gpu: bool, node: nodes.NodeInfo):
        """What the ranks of a new `role` instance on `node` run: the role's config, CPU threads
        shared out: a pinned rank's own cores, else the node's usable cores over the spec's ranks
        (not oversubscribed: with more OpenMP threads than cores, steps wait on descheduled ones),
        as a most: fewer while other processes take those cores (engine/core/threads.py TeamSizer).
        A spec's own num_threads is kept as given, fixed."""
        config = self.role_engine_config(role, gpu)
        if config.num_threads is None and not gpu:
            if self.spec.cpus_per_rank is not None:
                return replace(config, num_threads=self.spec.cpus_per_rank, adapt_threads=True)
            ranks = sum(n * self.spec.tp_size(r) for r, n in self.spec.instance_counts.items())
            cores = node.resources.get("CPU", 1) if self.multihost else cpu_plan.usable_cores()
            config = replace(config, num_threads=max(1, int(cores) // ranks), adapt_threads=True)
        return config

    def node_cpus(self, node: nodes.NodeInfo) -> int:
        return int(node.resources.get("CPU", 1)) if self.multihost else cpu_plan.usable_cores()

    def rank_cpu_plans(self, iid: str, tp: int, node: nodes.NodeInfo) -> list[cpu_plan.RankCpuPlan]:
        """Each rank's niceness and, with cpus_per_rank, a slot of the node's cores held for `iid`
        (released by `release_cores`). Raises PlacementError when the node has no room."""
        spec = self.spec
        if spec.cpus_per_rank is None:
            return [cpu_plan.RankCpuPlan(spec.rank_niceness)] * tp
        try:
            with self.cores_lock:
                slots = self.core_slots.take(node.node_id, self.node_cpus(node), iid, tp)
        except ValueError as exc:
            raise nodes.PlacementError(str(exc)) from None
        return [cpu_plan.RankCpuPlan(spec.rank_niceness, s, spec.cpus_per_rank, spec.reserved_cpus) for s in slots]

    def release_cores(self, iid: str) -> None:
        if self.core_slots is not None:
            with self.cores_lock:
                self.core_slots.release(iid)

    @property
    def rank_runtime_env(self) -> dict | None:
        """The environment rank processes start with (OpenMP reads it when torch loads); None when
        the spec adds nothing (omp_wait_policy inherit), as before there was a choice."""
        env = cpu_plan.wait_policy_env(self.spec.omp_wait_policy)
        return {"env_vars": env} if env else None

    def kv_same_device(self, gpu: bool) -> bool:
        """kv_transport auto: KV between ranks on one GPU is written into the decode cache (CUDA IPC,
        freed by the driver with its processes). CPUs keep the data channel: a POSIX shared-memory
        cache outlives a killed decode process in /dev/shm (measured: a test suite's killed actors
        left 9.6 GB there), so that path is for processes that close their receivers."""
        from engine.runner.model_runner import select_device
        return self.spec.kv_transport == "auto" and (gpu or select_device(self.spec.device).type == "cuda")

    def use_gpus(self) -> bool:
        import ray
        if self.spec.device == "cpu":
            return False
        return self.spec.device.startswith("cuda") or ray.cluster_resources().get("GPU", 0) > 0

