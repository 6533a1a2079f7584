"""The loop both workers run (engine/runner/worker_base.py), with a scripted worker: rank 0 steps until
stopped, sleeping only after a step that ran nothing, aborts silent clients' requests, then
releases the followers; a follower runs rank 0's steps until released."""
from __future__ import annotations

import threading

from engine.runner.worker_base import BaseWorker


class FakeTP:
    def __init__(self, rank: int, steps: list | None = None):
        self.rank, self.size, self.steps, self.sent = rank, 2, list(steps or []), []

    def broadcast_step(self, obj=None):
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        return self.steps.pop(0)


class FakeRunner:
    intraop_threads = 1

    def __init__(self, tp: FakeTP):
        self.tp = tp

    def expert_load_figures(self) -> dict[str, float]:
        return {}  # a dense model's


class ScriptedWorker(BaseWorker):
    """Steps report `work` in turn (then idle); the loop stops after the last (`stop`)."""
    idle_wait_s = 0.0

    def __init__(self, tp: FakeTP, work: list[bool] = (), client_ttl_s: float = 30.0):
        super().__init__(FakeRunner(tp), "fake-0", client_ttl_s)
        self.work, self.stop, self.aborted, self.followed = list(work), threading.Event(), [], []

    def step(self) -> bool:
        did = self.work.pop(0)
        if not self.work:
            self.stop.set()
        return did

    def follow(self) -> bool:
        step = self.tp.broadcast_step(None)
        self.followed.append(step)
        return step != "stop"

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    max_model_len = 64
    kv = None  # no allocator: nothing here asks it


def test_rank_0_steps_until_stopped_then_releases_the_followers(monkeypatch):
    """Every step runs; only a step that ran nothing is followed by a sleep; the followers get "stop" once, last."""
    sleeps = []
    monkeypatch.setattr("engine.runner.worker_base.time.sleep", sleeps.append)
    worker = ScriptedWorker(FakeTP(0), work=[True, False, True, False])
    worker.run(worker.stop)
    assert worker.work == [] and len(sleeps) == 2 and worker.tp.sent == ["stop"]


def test_a_follower_runs_rank_0s_steps_until_released():
    """A follower ignores the stop event: it stops when rank 0 broadcasts "stop"."""
    worker = ScriptedWorker(FakeTP(1, steps=["a", None, "stop"]))
    worker.stop.set()
    worker.run(worker.stop)
    assert worker.followed == ["a", None, "stop"]


def test_a_silent_clients_requests_are_aborted_and_counted():
    """Requests of a client that has not polled for client_ttl_s are aborted; a polling client's are not."""
    worker = ScriptedWorker(FakeTP(0), client_ttl_s=0.0)
    worker.outbox.add("a", "gone")
    worker.outbox.add("b", "gone")
    assert sorted(worker.abort_silent_clients()) == ["a", "b"] and sorted(worker.aborted) == ["a", "b"]
    assert worker.load()["orphans_aborted"] == 2.0
    worker.client_ttl_s = 30.0
    worker.outbox.add("c", "here")
    assert worker.poll_outputs(0.0, "here") == [] and worker.abort_silent_clients() == []
