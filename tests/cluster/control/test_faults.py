"""Fault injection under load on Ray (tiny model): SIGKILL every rank of a prefill or a decode
instance while requests stream. Every request finishes with the unfailed greedy output (or a
clear error), each stream resumes within 5 s of the kill with no token repeated or lost, the
cluster starts a replacement, and every allocator ends full."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
RECOVERY_S = 5.0


def spec_for(model: str, **kw) -> ClusterSpec:
    base = dict(model=model, dtype="float32", device="cpu", num_kv_blocks=256, block_size=8, max_num_seqs=32,
                max_num_batched_tokens=256, kv_transfer_timeout_s=5.0, num_threads=1, router_policy="round_robin",
                num_prefill=2, num_decode=2, heartbeat_ttl_s=3.0)
    return ClusterSpec(**{**base, **kw})


class Timed:
    """A listener that stamps every event of one request."""

    def __init__(self):
        self.events: list[tuple[float, list[int], bool, str | None]] = []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append((time.monotonic(), list(event.token_ids), event.finished, event.error))
        if event.finished:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for _, ids, _, _ in self.events for t in ids]

    def first_event_after(self, t: float) -> float | None:
        return next((when for when, *_ in self.events if when >= t), None)


def rank_pids(cluster: Cluster, instance_id: str) -> list[int]:
    import ray
    return ray.get([rank.pid.remote() for rank in cluster.instances[instance_id].ranks], timeout=30)


def kill_hard(pids: list[int]) -> None:
    """SIGKILL every rank process of an instance (no clean shutdown, like a crashed node)."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def greedy_reference(model: str, prompts) -> list[list[int]]:
    with Cluster(spec_for(model, mode="colocated", num_decode=1), use_ray=False) as c:
        return [s.token_ids for s in c.generate(prompts, PARAMS, timeout_s=120)]


def wait_busy(cluster: Cluster, instance_id: str, timeout_s: float) -> None:
    """Until the instance has a request running, waiting, reserved or queued (or `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    keys = ("running", "waiting", "reserved", "queued_prefill_tokens")
    while time.monotonic() < deadline:
        if any(cluster.instances[instance_id].client.load().get(k, 0.0) for k in keys):
            return
        time.sleep(0.005)


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_kill_under_load_every_request_recovers(ray_session, tiny_path, victim):
    prompts = random_prompts(24, [10, 60, 150], seed=21)
    want = greedy_reference(tiny_path, prompts)
    with Cluster(spec_for(tiny_path)) as c:
        listeners = [Timed() for _ in prompts]
        pids = rank_pids(c, victim)  # now: the kill must follow a submit at once
        half, killed_at = len(prompts) // 2, None
        for i, (p, lis) in enumerate(zip(prompts, listeners)):
            c.submit(f"r{i}", p, PARAMS, listener=lis)
            if i == half - 1:
                time.sleep(0.1)  # the first half is mid-stream or prefilling, then a burst comes:
                wait_busy(c, victim, 0.2)
            if i >= half - 1 and killed_at is None and not c.router.is_drained(victim):
                # the victim holds work it has not finished (a prefill: a prompt whose KV has not
                # reached its decode instance, which takes milliseconds; the kill takes microseconds)
                killed_at = time.monotonic()
                kill_hard(pids)
        assert killed_at is not None, "the victim never held unfinished work"
        for lis in listeners:
            assert lis.done.wait(120)
        errors = [lis.events[-1][3] for lis in listeners]
        assert errors == [None] * len(prompts), errors
        assert [lis.tokens for lis in listeners] == want  # nothing repeated, nothing lost
        waits = [(lis.first_event_after(killed_at) or killed_at) - killed_at for lis in listeners]
        assert max(waits) <= RECOVERY_S, waits
        # recovered by a retry elsewhere, or (a transfer cut mid-part) recomputed on the decode instance
        assert c.router.stats["retries"] + c.router.stats["kv_recomputes"] >= 1, c.router.stats
        deadline = time.monotonic() + 120
        while not (victim not in c.instances and len([i for i in c.instances.values()
                                                      if i.role == victim.split("-")[0]]) == 2):
            assert time.monotonic() < deadline, "no replacement started"
            time.sleep(0.2)
        c.assert_no_leaks()
        assert c.state.get(victim).health == "dead"  # kept, marked dead, until shutdown
