"""How a rank's process shares its host's CPUs (cluster/ranks/cpu_plan.py): quotas, the wait policy's
environment, core slots, and niceness and affinity applied to every thread (in child processes,
so the test process keeps its own)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.cli.cli import build_parser
from cluster.ranks import cpu_plan
from cluster.spec import ClusterSpec

REPO = Path(__file__).resolve().parents[3]


def test_cpu_quota_reads_cgroup_v2_and_v1(tmp_path):
    """v2 `cpu.max` "max" is no quota and "150000 100000" 1.5 cores; v1 reads cfs_quota_us over
    cfs_period_us, -1 meaning none; no files, no quota."""
    assert cpu_plan.cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_plan.cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_plan.cpu_quota(tmp_path) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_plan.cpu_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    assert cpu_plan.cpu_quota(v1) == 2.5


def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch):
    """A quota below the affinity caps the cores (rounded up: 1.5 cores keep 2 threads busy); none
    leaves the affinity; a tiny quota still gives one."""
    n = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_plan, "cpu_quota", lambda: None)
    assert cpu_plan.usable_cores() == n
    monkeypatch.setattr(cpu_plan, "cpu_quota", lambda: 0.1)
    assert cpu_plan.usable_cores() == 1
    monkeypatch.setattr(cpu_plan, "cpu_quota", lambda: n + 4.0)
    assert cpu_plan.usable_cores() == n
    if n >= 2:
        monkeypatch.setattr(cpu_plan, "cpu_quota", lambda: 1.5)
        assert cpu_plan.usable_cores() == 2


def test_wait_policy_env(monkeypatch):
    """passive and active set OMP_WAIT_POLICY; inherit sets nothing; a value already in the
    environment is the user's and wins; an unknown policy is refused by name."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_plan.wait_policy_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_plan.wait_policy_env("active") == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert cpu_plan.wait_policy_env("inherit") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert cpu_plan.wait_policy_env("passive") == {"OMP_WAIT_POLICY": "active"}
    with pytest.raises(ValueError, match="omp_wait_policy"):
        cpu_plan.wait_policy_env("spin")


def test_slots_split_a_nodes_cores_after_the_reserved_ones():
    """Slot k of a node takes cores reserved + k*n .. +n of its usable CPUs; a slot past the end is
    refused naming cpus_per_rank."""
    cpus = [0, 1, 2, 3, 4, 5, 8, 9]
    assert cpu_plan.slot_cpus(cpus, 0, 2, 1) == [1, 2]
    assert cpu_plan.slot_cpus(cpus, 2, 2, 1) == [5, 8]
    assert cpu_plan.num_slots(len(cpus), 2, 1) == 3
    assert cpu_plan.num_slots(1, 2, 1) == 0
    with pytest.raises(ValueError, match="cpus_per_rank 2: slot 3"):
        cpu_plan.slot_cpus(cpus, 3, 2, 1)


def test_core_slots_are_held_per_node_and_released():
    """An instance's ranks take the lowest free slots of their node; another node is apart; a full
    node is refused naming cpus_per_rank and what it has; released slots are free again; adopted
    ones are held."""
    slots = cpu_plan.CoreSlots(cpus_per_rank=2, reserved_cpus=1)
    assert slots.take("a", 9, "decode-0", 2) == [0, 1]
    assert slots.take("b", 9, "prefill-0", 1) == [0]
    assert slots.take("a", 9, "prefill-0", 1) == [2]
    with pytest.raises(ValueError, match=r"cpus_per_rank 2: decode-1 needs 2 slot\(s\).* 1 free of 9"):
        slots.take("a", 9, "decode-1", 2)
    slots.release("decode-0")
    assert slots.take("a", 9, "decode-1", 2) == [0, 1]
    slots.hold("b", "decode-9", [1, 2])
    with pytest.raises(ValueError):
        slots.take("b", 9, "x", 2)


def test_format_cpus():
    """Runs of consecutive cores are ranges."""
    assert cpu_plan.format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_plan.format_cpus([3]) == "3"


def _in_child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_apply_sets_every_thread_and_new_threads_inherit():
    """apply() puts every thread of the process (one started before it too) at the plan's niceness
    and, pinned, on its slot's cores; a thread started after inherits both; cpu_state reports the
    step thread's."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    plan = "RankCpuPlan(7, 0, 1, 1)" if pinned else "RankCpuPlan(7)"
    got = _in_child(f"""
        import json, os, threading
        from cluster.ranks import cpu_plan
        from cluster.ranks.cpu_plan import RankCpuPlan
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        cpu_plan.apply({plan})
        after = threading.Thread(target=stop.wait); after.start()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        out = {{"nice": sorted({{os.getpriority(os.PRIO_PROCESS, t) for t in tids}}),
               "cpus": sorted({{tuple(sorted(os.sched_getaffinity(t))) for t in tids}}),
               "state": cpu_plan.cpu_state(after.native_id, 3)}}
        stop.set(); print(json.dumps(out))""")
    assert got["nice"] == [7]
    want = [cpus[1]] if pinned else cpus
    assert got["cpus"] == [want]
    assert got["state"]["niceness"] == 7 and got["state"]["cpus"] == cpu_plan.format_cpus(want)
    assert got["state"]["intraop_threads"] == 3 and got["state"]["num_threads"] >= 3


def test_keep_off_ranks_pins_the_serving_process_to_the_reserved_cores():
    """With cpus_per_rank, the gateway's process (every thread) runs on the first reserved_cpus
    cores; without it, it is left alone."""
    cpus = sorted(os.sched_getaffinity(0))
    got = _in_child("""
        import json, os
        from cluster.ranks import cpu_plan
        from cluster.spec import ClusterSpec
        cpu_plan.keep_off_ranks(ClusterSpec())
        left = sorted(os.sched_getaffinity(0))
        cpu_plan.keep_off_ranks(ClusterSpec(cpus_per_rank=1, reserved_cpus=1, ray_address="auto"))
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print(json.dumps({"left": left, "pinned": sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tids})}))""")
    assert got["left"] == cpus and got["pinned"] == [[cpus[0]]]


def test_spec_refuses_what_cannot_work():
    """niceness outside -20..19, no cores per rank, negative reserved cores and an unknown wait
    policy are refused naming the key; the CLI's choices refuse an unknown policy too; a host
    without the cores the pinned ranks need is refused before anything starts."""
    for kwargs, name in (({"rank_niceness": 20}, "rank_niceness"), ({"rank_niceness": -21}, "rank_niceness"),
                         ({"cpus_per_rank": 0}, "cpus_per_rank"), ({"reserved_cpus": -1}, "reserved_cpus"),
                         ({"omp_wait_policy": "spin"}, "omp_wait_policy")):
        with pytest.raises(ValueError, match=name):
            ClusterSpec(**kwargs)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--omp-wait-policy", "spin"])
    args = build_parser().parse_args(["serve", "--cpus-per-rank", "2", "--rank-niceness", "-5"])
    assert (args.cpus_per_rank, args.rank_niceness) == (2, -5)
    with pytest.raises(ValueError, match=r"cpus_per_rank 4096: 2 rank\(s\) x 4096 cores \+ 1 reserved_cpus"):
        cpu_plan.check_host_cores(ClusterSpec(cpus_per_rank=4096))
    cpu_plan.check_host_cores(ClusterSpec(cpus_per_rank=4096, ray_address="auto"))  # nodes checked at placement
