"""How ranks share GPUs (cluster/control/gpu_share.py) and what the controller asks of Ray and of the engine
with that plan: pure functions, and the controller's own methods with Ray's GPU count faked (no Ray
started, no GPU needed)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from cluster.control.controller import Controller
from cluster.control.instance import Instance
from cluster.control.gpu_share import GpuPlan, RoleShare, gpu_plan
from cluster.ranks import nodes
from cluster.spec import ClusterSpec

NODE = nodes.NodeInfo("id-1", "10.0.0.1", {"CPU": 16.0, "GPU": 1.0})


def assert_fits_one_gpu(plan: GpuPlan) -> None:
    """What one GPU's group asks of Ray, and of the GPU's memory, is at most the whole GPU."""
    assert sum(s.num_gpus * s.ranks_per_gpu for s in plan.roles.values()) <= 1
    assert sum(s.gpu_memory_utilization * s.ranks_per_gpu for s in plan.roles.values()) <= 1 + 1e-9


def test_1p1d_on_one_gpu_shares_it_decode_taking_two_thirds():
    """The default cluster on one GPU: both ranks fit on it (their num_gpus add up to <= 1, each
    under 1 so Ray packs them together); gpu_memory_utilization 0.9 is split 1:2, prefill:decode;
    decode starts first."""
    plan = gpu_plan(ClusterSpec(), 1)
    assert plan.shared and plan.num_ranks == 2
    assert plan.roles["prefill"] == RoleShare(num_gpus=0.3333, gpu_memory_utilization=pytest.approx(0.3),
                                              ranks_per_gpu=1)
    assert plan.roles["decode"] == RoleShare(num_gpus=0.6666, gpu_memory_utilization=pytest.approx(0.6),
                                             ranks_per_gpu=1)
    assert plan.start_order == ("decode", "prefill")
    assert_fits_one_gpu(plan)
    assert plan.describe() == ("2 ranks share 1 GPU (1 prefill + 1 decode per GPU): num_gpus prefill 0.3333 decode "
                               "0.6666, gpu_memory_utilization prefill 0.30 decode 0.60; instances start one at a "
                               "time, decode first")


def test_2p2d_on_one_gpu_splits_the_budget_over_four_ranks():
    """Four ranks on one GPU: each prefill rank gets a sixth of the budget, each decode rank a
    third; all four fit in Ray's accounting of the GPU and in its memory."""
    plan = gpu_plan(ClusterSpec(num_prefill=2, num_decode=2), 1)
    assert {r: s.ranks_per_gpu for r, s in plan.roles.items()} == {"prefill": 2, "decode": 2}
    assert plan.roles["prefill"].gpu_memory_utilization == pytest.approx(0.15)
    assert plan.roles["decode"].gpu_memory_utilization == pytest.approx(0.3)
    assert (plan.roles["prefill"].num_gpus, plan.roles["decode"].num_gpus) == (0.1666, 0.3333)
    assert_fits_one_gpu(plan)


@pytest.mark.parametrize("num_gpus", [2, 4])
def test_a_gpu_per_rank_when_there_are_enough(num_gpus):
    """With at least as many GPUs as ranks nothing is shared: num_gpus 1.0 and the spec's
    gpu_memory_utilization for every rank, in the spec's role order."""
    plan = gpu_plan(ClusterSpec(gpu_memory_utilization=0.85), num_gpus)
    assert not plan.shared
    assert plan.roles == {"prefill": RoleShare(1.0, 0.85, 1), "decode": RoleShare(1.0, 0.85, 1)}
    assert plan.start_order == ("prefill", "decode")
    assert plan.describe().startswith(f"2 ranks on {num_gpus} GPUs: a GPU each")


def test_no_gpu_at_all_plans_a_gpu_per_rank():
    """Zero GPUs is not sharing (placement then says no node has a GPU, as before)."""
    assert not gpu_plan(ClusterSpec(), 0).shared


def test_groups_over_several_gpus_keep_decode_first():
    """2 prefill + 4 decode on 2 GPUs: 1 prefill + 2 decode per GPU; num_gpus follow the memory
    shares, so no two decode ranks plus a prefill rank exceed one GPU whichever way Ray packs them."""
    plan = gpu_plan(ClusterSpec(num_prefill=2, num_decode=4), 2)
    assert {r: (s.ranks_per_gpu, s.num_gpus) for r, s in plan.roles.items()} == \
        {"prefill": (1, 0.2), "decode": (2, 0.4)}
    assert plan.roles["decode"].gpu_memory_utilization == pytest.approx(0.36)
    assert plan.start_order == ("decode", "prefill")
    assert_fits_one_gpu(plan)


@pytest.mark.parametrize("kw, named", [
    ({"prefill_tp": 2}, "prefill_tp=2"),
    ({"decode_tp": 2}, "decode_tp=2"),
    ({"prefill_tp": 2, "decode_tp": 2}, "prefill_tp=2, decode_tp=2"),
    ({"mode": "colocated", "num_prefill": 0, "decode_tp": 2}, "decode_tp=2"),
])
def test_tensor_parallel_on_a_shared_gpu_is_refused(kw, named):
    """An instance with tp > 1 cannot have its ranks share a GPU (NCCL refuses two ranks on one
    device): one line naming the TP key and the GPU count."""
    with pytest.raises(ValueError, match=f"^{named}: .* ranks would share 1 GPU, .*tensor-parallel") as exc:
        gpu_plan(ClusterSpec(**kw), 1)
    assert "\n" not in str(exc.value)


def test_tensor_parallel_with_a_gpu_per_rank_is_fine():
    """tp=2 prefill + tp=1 decode on 3 GPUs: every rank has its own GPU."""
    plan = gpu_plan(ClusterSpec(prefill_tp=2), 3)
    assert not plan.shared and plan.roles["prefill"].num_gpus == 1.0


def test_explicit_fractions_are_used_and_set_num_gpus():
    """Explicit per-role keys replace the derived split; each rank's num_gpus is its part of what
    the group uses, so the two still pack on one GPU."""
    spec = ClusterSpec(prefill_gpu_memory_utilization=0.2, decode_gpu_memory_utilization=0.7)
    plan = gpu_plan(spec, 1)
    assert (plan.roles["prefill"].gpu_memory_utilization, plan.roles["decode"].gpu_memory_utilization) == (0.2, 0.7)
    assert (plan.roles["prefill"].num_gpus, plan.roles["decode"].num_gpus) == (0.2222, 0.7777)
    assert_fits_one_gpu(plan)
    one = gpu_plan(ClusterSpec(decode_gpu_memory_utilization=0.5), 1)  # the other role keeps its derived part
    assert one.roles["prefill"].gpu_memory_utilization == pytest.approx(0.3)
    assert one.roles["decode"].gpu_memory_utilization == 0.5


def test_explicit_fractions_apply_without_sharing_too():
    """With a GPU per rank, a role's own key replaces gpu_memory_utilization for that role only."""
    plan = gpu_plan(ClusterSpec(decode_gpu_memory_utilization=0.95), 2)
    assert plan.roles["decode"] == RoleShare(1.0, 0.95, 1) and plan.roles["prefill"].gpu_memory_utilization == 0.9


@pytest.mark.parametrize("kw, gpus", [
    ({"prefill_gpu_memory_utilization": 0.5, "decode_gpu_memory_utilization": 0.6}, 1),
    ({"decode_gpu_memory_utilization": 0.8}, 1),  # + derived prefill 0.3
    ({"num_decode": 3, "decode_gpu_memory_utilization": 0.6}, 2),  # 1 prefill + 2 decode ranks per GPU
])
def test_shares_over_one_gpu_are_refused(kw, gpus):
    """Fractions of the ranks on one shared GPU that add up to more than 1: one line naming both keys."""
    with pytest.raises(ValueError, match="^prefill_gpu_memory_utilization and decode_gpu_memory_utilization: "
                                         ".* more than 1") as exc:
        gpu_plan(ClusterSpec(**kw), gpus)
    assert "\n" not in str(exc.value)


def test_colocated_instances_share_alike():
    """Colocated mode: its instances split the GPU evenly; decode's key is theirs."""
    plan = gpu_plan(ClusterSpec(mode="colocated", num_prefill=0, num_decode=2), 1)
    assert plan.roles == {"colocated": RoleShare(0.5, pytest.approx(0.45), 2)}
    assert plan.describe().endswith("instances start one at a time")
    own = gpu_plan(ClusterSpec(mode="colocated", num_decode=2, decode_gpu_memory_utilization=0.4), 1)
    assert own.roles["colocated"] == RoleShare(0.5, 0.4, 2)
    with pytest.raises(ValueError, match="^decode_gpu_memory_utilization: .*2 colocated x 0.60"):
        gpu_plan(ClusterSpec(mode="colocated", num_decode=2, decode_gpu_memory_utilization=0.6), 1)
    assert not gpu_plan(ClusterSpec(mode="colocated", num_decode=2), 2).shared


# -- the controller with a plan ------------------------------------------------------------------
@pytest.fixture
def controller_on(monkeypatch):
    """A controller (not started) whose Ray cluster reports `gpus` GPUs."""
    import ray

    def create(gpus: int, **kw) -> Controller:
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": float(gpus)})
        return Controller(ClusterSpec(device="cuda", **kw))
    return create


def test_controller_asks_ray_for_each_roles_share(controller_on):
    """Rank resources (placement bundle and actor) carry the plan's num_gpus per role; the engine
    config carries its gpu_memory_utilization (the rest of the config is the spec's)."""
    c = controller_on(1)
    assert c.planner.rank_resources("prefill", True) == {"CPU": 1.0, "GPU": 0.3333}
    assert c.planner.rank_resources("decode", True) == {"CPU": 1.0, "GPU": 0.6666}
    assert nodes.pinned_bundles(c.planner.rank_resources("decode", True), NODE, 1) == \
        [{"CPU": 1.0, "GPU": 0.6666, "node:10.0.0.1": nodes.PIN}]
    prefill, decode = c.planner.engine_config("prefill", True, NODE), c.planner.engine_config("decode", True, NODE)
    assert prefill.cache.gpu_memory_utilization == pytest.approx(0.3)
    assert decode.cache.gpu_memory_utilization == pytest.approx(0.6)
    assert decode.cache.block_size == c.spec.engine_config("decode").cache.block_size
    assert (decode.scheduler, decode.tp_size) == (c.spec.engine_config("decode").scheduler, 1)


def test_controller_with_a_gpu_per_rank_is_unchanged(controller_on):
    """Enough GPUs: a whole GPU per rank and the spec's engine config, as before the plan."""
    c = controller_on(2)
    assert c.planner.rank_resources("prefill", True) == {"CPU": 1.0, "GPU": 1.0}
    assert c.planner.engine_config("decode", True, NODE) == c.spec.engine_config("decode")
    assert c.planner.rank_resources("decode", False) == {"CPU": 1.0}


def test_controller_adopts_only_what_it_would_start(controller_on):
    """Adoption compares an instance's config with the planned one: an instance started with
    the shared GPU's fraction is the spec's; one with the unshared fraction is not."""
    c = controller_on(1)
    assert c.adopter.same_engine(c.planner.engine_config("decode", True, NODE), "decode")
    assert not c.adopter.same_engine(c.spec.engine_config("decode"), "decode")


def test_controller_starts_decode_first_one_at_a_time(controller_on):
    """On a shared GPU the initial instances start decode first, one at a time, each under the start
    lock (so no other addition overlaps it); with a GPU each, all at once (each on a thread of its
    own, all waited for) without the lock. Either way the instances owed are in the start order."""
    for gpus, order, locked in ((1, ["decode", "decode", "prefill"], True), (3, ["prefill", "decode", "decode"], False)):
        c = controller_on(gpus, num_decode=2)
        c.planner.gpu_plan()
        started, inside, most = [], [0], [0]
        lock = threading.Lock()

        def no_room(role, iid, tp, c=c, started=started):
            with lock:
                started.append((role, c._start_lock.locked(), threading.current_thread() is threading.main_thread()))
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.2)  # long enough for the others to start meanwhile, when they start at once
            with lock:
                inside[0] -= 1
            raise nodes.PlacementError("no room")  # nothing starts; the instance is owed
        c._create_ray = no_room
        c.wait_for_room = True
        c._create_missing()
        assert c.starts_at_once is not locked and c.owed == order
        if locked:
            assert started == [(r, True, True) for r in order] and most[0] == 1
        else:
            assert sorted(started) == sorted((r, False, False) for r in order) and most[0] == len(order)


def test_a_failed_start_among_several_at_once_is_raised_after_all_are_done(controller_on):
    """Instances starting at once: the first failure (in the start order) is raised once every
    other start has ended, and the instances that did start are the controller's (start()'s
    shutdown stops them); ids stay unique across the threads."""
    c = controller_on(3, num_decode=2)
    c.planner.gpu_plan()
    ended = []

    def start(role, iid, tp):
        if role == "prefill":
            raise RuntimeError("prefill model failed to load")
        time.sleep(0.2)
        ended.append(iid)
        return Instance(iid, role, tp, [], SimpleNamespace(info=SimpleNamespace(
            kv_endpoints=(), max_model_len=64, block_size=16, engine={})))
    c._create_ray = start
    c._register = lambda inst: None
    with pytest.raises(RuntimeError, match="prefill model failed to load"):
        c._create_missing()
    assert sorted(ended) == ["decode-0", "decode-1"] and sorted(c.instances) == ["decode-0", "decode-1"]


def test_start_refuses_the_plan_before_any_instance(controller_on, monkeypatch):
    """A tp=3 instance on one shared GPU fails in start() right after Ray is up: no instance is
    started or adopted."""
    import cluster.control.controller as controller_module
    monkeypatch.setattr(controller_module, "init_ray", lambda *args: False)
    c = controller_on(1, prefill_tp=3)
    c._create = lambda role: pytest.fail(f"a {role} instance was started")
    with pytest.raises(ValueError, match="^prefill_tp=3: 4 ranks would share 1 GPU"):
        c.start()
    assert c.instances == {}


# -- what Ray does with the fractions (logical GPUs: no device needed) ----------------------------
@pytest.fixture
def ray_with_two_gpus():
    """A local Ray that believes it has 2 GPUs."""
    from cluster.control.instance import setup_ray_auth
    setup_ray_auth()
    import ray
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.timeout(120)
def test_ray_packs_the_shares_on_one_gpu_and_a_tp_group_too(ray_with_two_gpus):
    """A tp=2 group of half-GPU bundles lands on one device although two are free (which is why
    tensor parallelism on shared GPUs is refused); 1P1D's shares (placement groups, actors asking
    for the bundle's num_gpus) then both fit on the other one."""
    ray = ray_with_two_gpus
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Rank:
        def gpu_ids(self) -> list[str]:
            return ray.get_runtime_context().get_accelerator_ids()["GPU"]

    def devices(bundles: list[dict]) -> list[list[str]]:
        pg = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        ranks = [Rank.options(num_gpus=b["GPU"], scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for i, b in enumerate(bundles)]
        return ray.get([r.gpu_ids.remote() for r in ranks], timeout=60)

    first, second = devices([{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}])
    assert first == second and len(first) == 1
    plan = gpu_plan(ClusterSpec(), 1)
    decode, prefill = (devices([{"CPU": 1.0, "GPU": plan.roles[r].num_gpus}]) for r in plan.start_order)
    assert decode == prefill != first
    assert ray.available_resources()["GPU"] == pytest.approx(0.0001)  # what Ray's unit leaves of the 1P1D GPU
