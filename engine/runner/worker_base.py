"""What a prefill rank and a decode rank share: outputs queued per client (router), the requests of
clients that went silent aborted, and the loop that drives the rank.

    rank 0      while not stopped: step()  (after a step that ran nothing: sleep idle_wait_s)
                    once a second: abort_silent_clients()
                then stop_followers()
    ranks > 0   while follow(): run the step rank 0 broadcast   (until rank 0's stop_followers)

The roles differ in their steps (a prefill batch and its KV shipments; a decode batch, the KV
transfers that completed, the forks), in how they take requests and in what they report.

`Outbox`: per-client queues of a worker's outputs.

Several routers (one per gateway) share an instance; each long-polls only the outputs of its own
requests, addressed by `RequestMessage.client_id` (vLLM v1 routes EngineCoreOutputs to its API servers
by `client_index` alike). A client that stops polling for `ttl_s` is gone (its gateway died): the
worker aborts its requests (`drop_silent` names them), so their blocks are freed."""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.block_manager import KVCacheManager
    from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class BaseWorker(ABC):
    # NOTE: rank 0 sleeps between idle steps even while KV is arriving: a busy loop would hold the GIL
    # and starve this process's KV threads (a decode's receiver: transfers took 100x longer).
    idle_wait_s = 0.001
    silent_clients_check_s = 1.0  # how often rank 0 looks for clients that stopped polling

    def __init__(self, runner: ModelRunner, instance_id: str, client_ttl_s: float):
        """`client_ttl_s`: a client (router) that has not polled for this long is gone (its gateway
        died); its requests are aborted, so their blocks are freed."""
        self.runner, self.tp, self.instance_id = runner, runner.tp, instance_id
        self.client_ttl_s = client_ttl_s
        self.outbox = Outbox()  # outputs per client (router): each gateway gets only its own
        self.num_orphans_aborted = 0  # requests of clients that went silent

    @abstractmethod
    def step(self) -> bool:
        """Rank 0: one step, which the followers run too (with nothing to run, a step makes no
        collective call: the followers wait on the control group).

        Returns:
            whether to step again at once; False: the loop sleeps `idle_wait_s` first (a decode ran
            no batch, a prefill had no work).
        """

    @abstractmethod
    def follow(self) -> bool:
        """Ranks > 0: run the step rank 0 broadcast. Returns False when told to stop."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Rank 0 (thread-safe): ends the request here, wherever it is, and frees its blocks."""

    # -- what differs by role, asked of the worker (cluster/ranks/rank.py never branches on the role) --
    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) this instance holds."""

    @property
    @abstractmethod
    def kv(self) -> KVCacheManager:
        """Rank 0: the instance's KV block allocator, its prefix cache included."""

    def assert_no_leaks(self) -> None:
        """Rank 0 (tests): every block of the instance's KV allocator is free."""
        self.kv.assert_no_leaks()

    def kv_events(self, since: int) -> dict:
        """Rank 0 (thread-safe): what its prefix cache stored and evicted after event `since`, or a
        snapshot of what it holds (engine/core/kv_events.py): a router's prefix index follows it."""
        return self.kv.block_pool.events.since(since)

    def describe(self) -> dict[str, str]:
        """What this role adds to the engine's description for /status (a decode's speculation)."""
        return {}

    def close(self) -> None:
        """Releases what the role holds beyond the runner (a prefill's transfer leases)."""

    def load(self) -> dict[str, float]:
        """Rank 0: figures for the router's policy, the autoscaler and /status; each role adds its own."""
        tier = getattr(self.kv, "tier", None)
        return {"orphans_aborted": float(self.num_orphans_aborted),
                "intraop_threads": float(self.runner.intraop_threads),  # rank 0's, now (engine/core/threads.py)
                **self.runner.expert_load_figures(),  # a mixture's, per sparse layer (engine/layers/moe.py)
                **(tier.figures() if tier is not None else {}),  # a host tier's (engine/core/host_tier.py)
                **(self.runner.host_arena.figures() if tier is not None else {})}  # its copies' seconds

    def expert_counts(self) -> dict[int, list[int]]:
        """Rank 0: per sparse layer, the tokens routed to each expert since start ({}: a dense
        model); every rank routes alike, so rank 0's counts are the instance's."""
        return self.runner.expert_counts()

    def poll_outputs(self, timeout: float = 0.0, client_id: str = "") -> list:
        """Rank 0 (thread-safe), a long poll: the outputs of `client_id`'s requests since its last call,
        waiting up to `timeout` for the first (a prefill's PrefillResults, a decode's RequestOutputs)."""
        return self.outbox.take(client_id, timeout)

    def abort_silent_clients(self) -> list[str]:
        """Rank 0: aborts the requests of clients that have not polled for `client_ttl_s`; returns their ids."""
        orphans = self.outbox.drop_silent(self.client_ttl_s)
        for rid in orphans:
            self.abort(rid)
        self.num_orphans_aborted += len(orphans)
        return orphans

    def stop_followers(self) -> None:
        """Rank 0: ends the followers' loops."""
        self.tp.broadcast_step("stop")

    def run(self, stop: threading.Event) -> None:
        """The rank's loop, on the thread that built its model, until `stop` is set (rank 0; it then
        releases the followers) or rank 0 releases it (ranks > 0)."""
        if self.tp.rank > 0:
            while self.follow():
                pass
            return
        checked = time.monotonic()
        while not stop.is_set():
            if not self.step():
                time.sleep(self.idle_wait_s)
            if time.monotonic() - checked > self.silent_clients_check_s:
                checked = time.monotonic()
                if orphans := self.abort_silent_clients():
                    logger.warning("%s: aborted %d requests of clients silent for %.0f s", self.instance_id,
                                   len(orphans), self.client_ttl_s)
        self.stop_followers()


class Outbox:
    def __init__(self):
        self._cond = threading.Condition()
        self._queues: dict[str, list] = {}  # client id -> outputs not yet taken
        self._last_poll: dict[str, float] = {}  # client id -> monotonic time of its last take (or add)
        self._client_of: dict[str, str] = {}  # request id -> client id, until forgotten

    def add(self, request_id: str, client_id: str) -> None:
        """A client placed `request_id` here: its outputs are kept for that client from now on."""
        with self._cond:
            self._client_of[request_id] = client_id
            self._queues.setdefault(client_id, [])
            self._last_poll.setdefault(client_id, time.monotonic())

    def put(self, request_id: str, item, last: bool = False) -> None:
        """Queues `item` for the request's client (dropped if the client is gone); `last`: the
        request has no more outputs (it is forgotten)."""
        with self._cond:
            client = self._client_of.pop(request_id, "") if last else self._client_of.get(request_id, "")
            if client in self._queues:
                self._queues[client].append(item)
                self._cond.notify_all()

    def client_of(self, request_id: str) -> str:
        with self._cond:
            return self._client_of.get(request_id, "")

    def forget(self, request_id: str) -> None:
        with self._cond:
            self._client_of.pop(request_id, None)

    def take(self, client_id: str, timeout: float) -> list:
        """Everything queued for `client_id`, waiting up to `timeout` for the first (long poll)."""
        with self._cond:
            self._queues.setdefault(client_id, [])
            self._last_poll[client_id] = time.monotonic()
            if not self._queues[client_id] and timeout > 0:
                self._cond.wait_for(lambda: bool(self._queues.get(client_id)), timeout)
            out, self._queues[client_id] = self._queues.get(client_id, []), []
            self._last_poll[client_id] = time.monotonic()
            return out

    def drop_silent(self, ttl_s: float) -> list[str]:
        """Forgets the clients that have not polled for `ttl_s`; returns their requests' ids (the
        caller aborts them)."""
        with self._cond:
            now = time.monotonic()
            gone = {c for c, t in self._last_poll.items() if now - t > ttl_s}
            for c in gone:
                del self._last_poll[c], self._queues[c]
            orphans = [rid for rid, c in self._client_of.items() if c in gone]
            for rid in orphans:
                del self._client_of[rid]
            return orphans
