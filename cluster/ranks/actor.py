"""The Ray actor that hosts one rank of an instance (see cluster/ranks/rank.py). Typed methods only.

The actor finds its own node's address (cluster/ranks/nodes.py: PDSERVE_NODE_IP, else Ray's address of
the node it runs on; 127.0.0.1 on a single-host Ray) and binds its TP rendezvous and KV endpoint
there; gloo and NCCL are pointed at the interface that holds it before any process group exists.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import ray
import torch

from engine.core import tracing
from cluster.ranks import cpu_plan
from cluster.ranks.nodes import RankPlacement, node_address, set_socket_ifnames, unreachable
from cluster.ranks.rank import RankHost, TPRendezvous, open_rendezvous
from engine.core.config import EngineConfig
from engine.core.request import RequestMessage
from kvtransfer.params import KVEndpoint, KVTransferParams, Reservation
from kvtransfer.registry import DEFAULT as DEFAULT_TRANSPORT


class _Followers:
    """Rank 0's view of the other ranks' receiving KV connectors: each call returns once all did it."""

    def __init__(self, actors: list):
        self.actors = actors

    def expect(self, request_id: str, slots: list[torch.Tensor], prefill_tp: int) -> None:
        ray.get([a.expect.remote(request_id, slots, prefill_tp) for a in self.actors])

    def forget(self, request_id: str) -> None:
        ray.get([a.forget.remote(request_id) for a in self.actors])


@ray.remote(max_concurrency=32)  # every router long-polls it: those must not block reserve/submit calls
class RankActor:
    def __init__(self, config: EngineConfig, role: str, instance_id: str, rank: int, tp_size: int,
                 kv_timeout_s: float, log_level: str = "INFO", loopback: bool = False, client_ttl_s: float = 30.0,
                 kv_same_device: bool = True, cpu: cpu_plan.RankCpuPlan = cpu_plan.RankCpuPlan(),
                 kv_checksum: bool = False, kv_transport: str = DEFAULT_TRANSPORT,
                 trace_to: tracing.TracingConfig | None = None):
        """`loopback`: the driver started Ray on this one host; bind 127.0.0.1. `kv_same_device`:
        the spec's kv_transport is auto (KV within one device is written into the decode cache).
        `cpu`: this process's niceness and cores, applied before the rank's threads start.
        `kv_checksum`: the spec's (every KV part carries a checksum, checked on receipt). `kv_transport`:
        the KV transport's name (kvtransfer/registry.py). `trace_to`: the spec's tracing (engine/core/tracing.py)."""
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        tracing.configure(trace_to)
        self._cpu = cpu
        cpu_plan.apply(cpu)
        self._args = (config, role, instance_id, rank, tp_size)
        self._kv_timeout_s, self._client_ttl_s, self._kv_same_device = kv_timeout_s, client_ttl_s, kv_same_device
        self._kv_checksum, self._kv_transport = kv_checksum, kv_transport
        self._host_name = node_address(loopback)
        self._ifname = set_socket_ifnames(self._host_name)  # before any process group: gloo/NCCL read them once
        self.host: RankHost | None = None
        self._complete = False  # rank 0: the controller finished starting the instance
        self._tp_listener = None  # rank 0: the TP rendezvous's socket, until setup's store takes it

    def placement(self) -> RankPlacement:
        """Where this rank runs: the address it binds and advertises, and its process id."""
        return RankPlacement(self._args[3], self._host_name, os.getpid())

    def socket_interface(self) -> str | None:
        """The network interface that holds this rank's address (gloo/NCCL use it), or None."""
        return self._ifname

    def probe(self, endpoints: list[tuple[str, int]], timeout_s: float) -> list[str]:
        """The endpoints ("host:port") a plain TCP connection from this rank's node cannot reach."""
        return unreachable(endpoints, timeout_s)

    def describe(self) -> dict:
        """What a controller that did not start this rank needs to adopt it: role, instance_id,
        tp_size, rank, ready (model loaded, TP group joined), kv_endpoint, max_model_len, block_size, engine,
        placement (with its CPU state once ready), cpu_slot (its pinned cores' slot, or None), config (the
        EngineConfig it runs)."""
        config, role, instance_id, rank, tp_size = self._args
        ready = self.host is not None and (rank > 0 or self._complete)
        placement = replace(self.placement(), cpu=self.cpu()) if ready else self.placement()
        return {"role": role, "instance_id": instance_id, "tp_size": tp_size, "rank": rank, "ready": ready,
                "kv_endpoint": self.host.kv_endpoint() if ready else None,
                "max_model_len": self.host.max_model_len if ready else 0,
                "block_size": self.host.block_size if ready else 0, "engine": self.host.engine if ready else {},
                "placement": placement, "cpu_slot": self._cpu.slot, "config": config}

    def mark_complete(self) -> None:
        """Rank 0: every rank is set up (followers known): the instance may be adopted."""
        self._complete = True

    def rendezvous_address(self) -> TPRendezvous:
        """Rank 0: where the instance's TP group meets, on this rank's address only, under a fresh
        random prefix (the driver hands it to every rank's `setup`; it travels through Ray only)."""
        if self._tp_listener is not None:
            self._tp_listener.close()
        rendezvous, self._tp_listener = open_rendezvous(self._host_name)
        return rendezvous

    def setup(self, tp_address: TPRendezvous | None) -> KVEndpoint | None:
        """Loads the model, joins the TP group, starts the loop. Returns this rank's KV endpoint."""
        config, role, instance_id, rank, tp_size = self._args
        listener, self._tp_listener = self._tp_listener, None
        self.host = RankHost(config, role, instance_id, rank, tp_size, tp_address, self._host_name, self._kv_timeout_s,
                             on_loop_death=lambda: os._exit(1), client_ttl_s=self._client_ttl_s,
                             kv_same_device=self._kv_same_device, kv_checksum=self._kv_checksum,
                             tp_listener=listener, kv_transport=self._kv_transport)
        cpu_plan.set_niceness(self._cpu.niceness)  # threads Ray started meanwhile, too
        return self.host.kv_endpoint()

    def expect_flip(self, role: str, config: EngineConfig) -> None:
        """Ranks > 0, before rank 0's `flip`: rebuild as `role` when rank 0 releases this rank's loop."""
        self.host.expect_flip(role, config)

    def flip(self, role: str, config: EngineConfig) -> KVEndpoint | None:
        """Changes this rank's role in place (RankHost.flip; the instance drained first). Returns its KV
        endpoint in the new role."""
        self.host.flip(role, config)
        self._args = (config, role, *self._args[2:])  # (what an adopting controller reads: describe)
        return self.host.kv_endpoint()

    def cpu(self) -> dict:
        """How this rank shares its host's CPUs (cluster/ranks/cpu_plan.py cpu_state), for /status."""
        runner = self.host.runner
        most = runner.team.max_threads if runner.team is not None else runner.intraop_threads
        return cpu_plan.cpu_state(self.host.step_thread_id, most, runner.team is not None)

    def max_model_len(self) -> int:
        return self.host.max_model_len

    def block_size(self) -> int:
        return self.host.block_size

    def engine(self) -> dict[str, str]:
        return self.host.engine

    def pid(self) -> int:
        """This rank's process id (fault-injection tests kill it)."""
        return os.getpid()

    def set_followers(self, followers: list) -> None:
        """Rank 0: the other ranks' actors, so reservations (a prefill's fetches) and cancellations
        reach every rank's receiving KV connector."""
        self.host.worker.set_followers(_Followers(followers))

    # prefill
    def submit(self, msg: RequestMessage, params: KVTransferParams) -> None:
        self.host.worker.submit(msg, params)

    def fetch(self, msg: RequestMessage, params: KVTransferParams, num_tokens: int, holder_tp: int) -> int | None:
        return self.host.worker.fetch(msg, params, num_tokens, holder_tp)

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> str | None:
        return self.host.worker.ship_held(request_id, token_ids, params)

    def give_up_fetch(self, request_id: str) -> None:
        self.host.worker.give_up_fetch(request_id)

    # decode
    def reserve(self, msg: RequestMessage, prefill_tp: int) -> Reservation | None:
        return self.host.worker.reserve(msg, prefill_tp)

    def expect(self, request_id: str, slots: list[torch.Tensor], prefill_tp: int) -> None:
        self.host.worker.receiving.expect(request_id, slots, prefill_tp)

    def forget(self, request_id: str) -> None:
        self.host.worker.receiving.forget(request_id)

    def add_request(self, msg: RequestMessage) -> bool:
        return self.host.worker.add_request(msg)

    # both
    def poll_outputs(self, timeout: float, client_id: str = "") -> list:
        return self.host.worker.poll_outputs(timeout, client_id)

    def abort(self, request_id: str) -> None:
        self.host.worker.abort(request_id)

    def load(self) -> dict[str, float]:
        return self.host.worker.load()

    def expert_counts(self) -> dict[int, list[int]]:
        return self.host.worker.expert_counts()

    def kv_events(self, since: int) -> dict:
        return self.host.worker.kv_events(since)

    def kv_transfer_log(self) -> list[dict]:
        """Prefill ranks: the recent acknowledged transfers, with monotonic timestamps."""
        return list(self.host.sender.recent_transfers) if self.host.sender is not None else []

    def assert_no_leaks(self) -> None:
        """Tests: every block of this rank's allocator is free (rank 0 owns the allocator)."""
        self.host.assert_no_leaks()

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.shutdown()
        tracing.shutdown()  # what its spans' exporter holds goes out first
