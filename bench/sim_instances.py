"""Simulated instances for the control-plane benchmark (bench/control_plane.py): many instances per Ray
actor, each answering the instance interface (router/client.py, the rank actor's methods the controller
calls) with the times of a measured profile instead of a model.

    SimHost (an async Ray actor, named simhost-K)   hosts instances by id; `call(iid, method, *args)`
    MemberHandle(host, iid)                          what the controller and routers hold as the rank-0
                                                     actor: `handle.load.remote()` -> host.call(iid, "load")

A prefill instance computes its queue first in, first out at the profile's tokens/s, answers its
router with the first token, and tells the decode instance the KV arrived (on whichever host it is);
a decode instance reserves room for a request (max_num_seqs and its KV capacity), then emits one token
per step at itl(batch) until max_tokens. No tensors, no KV: only the timing and the messages.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque

from cluster.autoscale.autoscaler import Profile
from decode_worker.engine import RequestOutput
from kvtransfer.params import Reservation
from prefill_worker.worker import PrefillResult

HOST_PREFIX = "simhost-"


def host_name(instance_id: str, num_hosts: int) -> str:
    """The host actor of an instance: its number modulo the hosts (prefill-7 and decode-7 share one)."""
    return f"{HOST_PREFIX}{int(instance_id.rpartition('-')[2]) % num_hosts}"


class _Method:
    def __init__(self, host, iid: str, method: str):
        self.host, self.iid, self.method = host, iid, method

    def remote(self, *args):
        return self.host.call.remote(self.iid, self.method, *args)


class MemberHandle:
    """One simulated instance on a SimHost, shaped as its rank-0 actor's handle."""

    def __init__(self, host, instance_id: str):
        self._host, self._iid = host, instance_id

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self._host, self._iid, method)


class _Outbox:
    """Outputs per router (client id), long-polled."""

    def __init__(self):
        self.items: dict[str, list] = defaultdict(list)
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def put(self, client_id: str, item) -> None:
        self.items[client_id].append(item)
        self.ready[client_id].set()

    async def poll(self, timeout: float, client_id: str) -> list:
        if not self.items[client_id]:
            event = self.ready[client_id]
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.items[client_id] = self.items[client_id], []
        return out


class SimPrefill:
    def __init__(self, host: "SimHost", iid: str):
        self.host, self.iid, self.outbox = host, iid, _Outbox()
        self.queue: deque = deque()  # (msg, kv params, tokens)
        self.wake = asyncio.Event()
        self.computed = self.busy_s = 0.0
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, msg, params) -> None:
        self.queue.append((msg, params, len(msg.prompt_token_ids)))
        self.wake.set()

    def abort(self, request_id: str) -> None:
        self.queue = deque(item for item in self.queue if item[0].request_id != request_id)

    def give_up_fetch(self, request_id: str) -> None:
        pass

    def load(self) -> dict[str, float]:
        return {"queued_prefill_tokens": float(sum(n for *_, n in self.queue)), "waiting": float(len(self.queue)),
                "prefill_tokens_computed": self.computed, "prefill_busy_s": self.busy_s}

    async def _run(self) -> None:
        while True:
            if not self.queue:
                self.wake.clear()
                await self.wake.wait()
                continue
            msg, params, tokens = self.queue[0]
            seconds = tokens / self.host.profile.prefill_tokens_per_s
            await asyncio.sleep(seconds)
            if not self.queue or self.queue[0][0] is not msg:
                continue  # aborted meanwhile
            self.queue.popleft()
            self.computed, self.busy_s = self.computed + tokens, self.busy_s + seconds
            self.outbox.put(msg.client_id, PrefillResult(msg.request_id, first_token=1))
            await self.host.kv_to(params.decode_instance_id, msg.request_id)


class SimDecode:
    def __init__(self, host: "SimHost", iid: str):
        self.host, self.iid, self.outbox = host, iid, _Outbox()
        self.reserved: dict[str, object] = {}  # request id -> message, its KV not here yet
        self.running: dict[str, list] = {}  # request id -> [message, tokens emitted]
        self.kv_tokens = 0
        self.background = 0.0  # sequences it reports running beyond its own (a load step for the planner)
        self.steps = self.step_s = self.step_seqs = 0.0
        self.wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _tokens(self, msg) -> int:
        return len(msg.prompt_token_ids) + msg.sampling_params.max_tokens

    def reserve(self, msg, prefill_tp: int):
        p = self.host.profile
        if len(self.reserved) + len(self.running) >= p.max_num_seqs or \
                self.kv_tokens + self._tokens(msg) > p.kv_capacity_tokens:
            return None
        self.reserved[msg.request_id] = msg
        self.kv_tokens += self._tokens(msg)
        return Reservation(0)

    def add_request(self, msg) -> bool:
        """Colocated: the prompt is computed here (its time counted in the first step), then decoded."""
        if self.reserve(msg, 1) is None:
            return False
        self.kv_arrived(msg.request_id, first_here=True)
        return True

    def kv_arrived(self, request_id: str, first_here: bool = False) -> None:
        msg = self.reserved.pop(request_id, None)
        if msg is not None:
            self.running[request_id] = [msg, 0 if first_here else 1]
            self.wake.set()

    def abort(self, request_id: str) -> None:
        msg = self.reserved.pop(request_id, None) or (self.running.pop(request_id, [None])[0])
        if msg is not None:
            self.kv_tokens -= self._tokens(msg)

    def load(self) -> dict[str, float]:
        p = self.host.profile
        return {"running": len(self.running) + self.background, "reserved": float(len(self.reserved)),
                "kv_usage": self.kv_tokens / p.kv_capacity_tokens, "kv_capacity_tokens": float(p.kv_capacity_tokens),
                "decode_steps": self.steps, "decode_step_s": self.step_s, "decode_step_seqs": self.step_seqs}

    async def _run(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            step = self.host.profile.itl(len(self.running))
            await asyncio.sleep(step)
            self.steps, self.step_s = self.steps + 1, self.step_s + step
            self.step_seqs += len(self.running)
            for rid, entry in list(self.running.items()):
                msg, done = entry
                finished = done + 1 >= msg.sampling_params.max_tokens
                self.outbox.put(msg.client_id, RequestOutput(rid, [1], finished, "length" if finished else None,
                                                             start=done))
                entry[1] = done + 1
                if finished:
                    del self.running[rid]
                    self.kv_tokens -= self._tokens(msg)


class SimHost:
    """Hosts simulated instances (as a Ray actor: `ray.remote(SimHost).options(name=..., ...)`)."""

    def __init__(self, profile: dict, num_hosts: int, namespace: str):
        self.profile, self.num_hosts, self.namespace = Profile(**profile), num_hosts, namespace
        self.members: dict[str, SimPrefill | SimDecode] = {}
        self.silent: set[str] = set()  # instances that answer nothing any more (a cut link)
        self.calls = 0

    async def create(self, instance_id: str, role: str) -> None:
        self.members[instance_id] = SimPrefill(self, instance_id) if role == "prefill" else SimDecode(self, instance_id)

    async def call(self, instance_id: str, method: str, *args):
        self.calls += 1
        if instance_id in self.silent:
            await asyncio.Event().wait()  # never answers: the caller's deadline finds it dead
        member = self.members.get(instance_id)
        if member is None:
            raise RuntimeError(f"{instance_id} is not on {HOST_PREFIX}")
        if method == "poll_outputs":
            return await member.outbox.poll(*args)
        if method == "shutdown":
            member.task.cancel()
            del self.members[instance_id]
            return None
        if method in ("probe",):
            return []  # every KV endpoint reachable (there is no KV)
        if method in ("expert_counts",):
            return {}
        if method == "fetch":  # (nothing held to fetch: computed as submitted)
            member.submit(*args[:2])
            return None
        if method == "kv_events":
            return None
        return getattr(member, method)(*args)

    async def set_background(self, running: dict[str, float]) -> None:
        """Decode instances (id -> sequences) report that many more running: load the planner sees."""
        for instance_id, n in running.items():
            if isinstance(self.members.get(instance_id), SimDecode):
                self.members[instance_id].background = n

    async def silence(self, instance_id: str) -> None:
        self.silent.add(instance_id)

    async def kv_to(self, decode_id: str, request_id: str) -> None:
        """The prefill is done: the decode instance's KV arrived (a message to its host if another)."""
        name = host_name(decode_id, self.num_hosts)
        if decode_id in self.members:
            self.members[decode_id].kv_arrived(request_id)
            return
        import ray
        ray.get_actor(name, namespace=self.namespace).kv_arrived.remote(decode_id, request_id)

    async def kv_arrived(self, decode_id: str, request_id: str) -> None:
        member = self.members.get(decode_id)
        if isinstance(member, SimDecode):
            member.kv_arrived(request_id)

    async def stats(self) -> dict:
        return {"members": len(self.members), "calls": self.calls, "at": time.monotonic()}
