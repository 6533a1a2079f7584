"""One rank of one instance, wherever it runs (a Ray actor, or in-process in tests).

The TP group meets at rank 0's TCPStore, which rank 0 creates itself on a socket bound to its own
address (never every interface), its keys under a random prefix the driver hands to the followers
through Ray (`TPRendezvous`); the group's control messages are MACed under a key derived from the
cluster secret (`tp_group_key`, engine/parallel/tp_wire.py), so a process that reaches the store can spoil
the group but cannot make a rank decode, let alone unpickle, anything it sends.

`RankHost` builds the rank's model runner (joining its instance's tensor-parallel group), then its
role's KV transport end and worker (roles.py: prefill, decode, colocated) on a thread of its own,
then runs the worker's loop there: rank 0 drives, the other ranks follow the steps rank 0 broadcasts.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.core.config import EngineConfig
from engine.core.request import trailer_format
from engine.parallel.layers import TPGroup
from engine.runner.model_runner import ModelRunner, select_device
from cluster.ranks.roles import ROLES, RankSetting
from engine.speculative.registry import rows_signature
from kvtransfer.wire import cluster_secret
from kvtransfer.connector import Shipment
from kvtransfer.params import CompatRecord, KVEndpoint, KVTransferParams
from kvtransfer.registry import DEFAULT as DEFAULT_TRANSPORT

logger = logging.getLogger(__name__)


TP_KEY_LABEL = b"pdserve tp group v1"
# the records of the workers' control messages beyond the engine's: a prefill step's shipments
TP_WIRE_TYPES = (Shipment, KVTransferParams, KVEndpoint)


def tp_group_key() -> bytes:
    """The TP groups' control-message key: HMAC-SHA256(cluster secret, TP_KEY_LABEL)."""
    return hmac.digest(cluster_secret(), TP_KEY_LABEL, "sha256")


def free_address(host: str = "127.0.0.1") -> str:
    """host:port with a port that was free a moment ago."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@dataclass(frozen=True)
class TPRendezvous:
    """Where an instance's TP group meets: rank 0's store at host:port, its keys under `prefix`
    (random, known to the ranks through Ray only)."""
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, address: str) -> TPRendezvous:
        """From "host:port" (no prefix: callers that chose the port themselves, benchmarks)."""
        host, _, port = address.rpartition(":")
        return cls(host.strip("[]"), int(port), "")


def open_rendezvous(host: str) -> tuple[TPRendezvous, socket.socket]:
    """Rank 0: a listening socket bound to `host` (the rank's own address) on a free port, held
    until its store takes it (so no other process can take the port meanwhile), and a fresh prefix."""
    listener = socket.socket(_family(host))
    listener.bind((host, 0))
    listener.listen(128)
    return TPRendezvous(host, listener.getsockname()[1], secrets.token_hex(16)), listener


def tp_store(rank: int, tp_size: int, rendezvous: TPRendezvous, timeout: timedelta,
             listener: socket.socket | None = None) -> dist.Store:
    """The group's store: rank 0 serves it on `listener` (else on a socket it binds to the
    rendezvous host and port), the others connect; keys under the rendezvous's prefix."""
    if rank == 0:
        if listener is None:
            listener = socket.socket(_family(rendezvous.host))
            listener.bind((rendezvous.host, rendezvous.port))
            listener.listen(128)
        # NOTE: TCPStore serves on the socket it is given (libuv's backend honours master_listen_fd
        # in torch 2.13); detach(): the store owns and closes it
        store = dist.TCPStore(rendezvous.host, rendezvous.port, tp_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, tp_size, False, timeout=timeout)
    return dist.PrefixStore(f"pdserve-tp/{rendezvous.prefix}/", store)


def join_tp_group(device: torch.device, rank: int, tp_size: int, address: TPRendezvous | str,
                  listener: socket.socket | None = None) -> TPGroup:
    """This rank's TP group: on GPUs NCCL for the model's tensors and a gloo group beside it for
    the driver's messages (followers wait there while idle, so no NCCL call waits unmatched);
    on CPUs one gloo group for both. Rank 0 serves the rendezvous (on `listener` if given)."""
    rendezvous = TPRendezvous.parse(address) if isinstance(address, str) else address
    wire = {"key": tp_group_key(), "wire_types": TP_WIRE_TYPES}
    if device.type != "cuda":
        timeout = timedelta(hours=24)  # followers may idle for long
        dist.init_process_group("gloo", store=tp_store(rank, tp_size, rendezvous, timeout, listener), rank=rank,
                                world_size=tp_size, timeout=timeout)
        return TPGroup(rank, tp_size, dist.group.WORLD, device=device, **wire)
    torch.cuda.set_device(device)
    timeout = timedelta(minutes=10)  # collectives run matched: in step
    dist.init_process_group("nccl", store=tp_store(rank, tp_size, rendezvous, timeout, listener), rank=rank,
                            world_size=tp_size, timeout=timeout, device_id=device)
    control = dist.new_group(backend="gloo", timeout=timedelta(hours=24))
    logger.info("TP rank %d/%d: NCCL for tensors on %s, gloo for control", rank, tp_size, device)
    return TPGroup(rank, tp_size, dist.group.WORLD, control, device, **wire)


@dataclass
class _Flip:
    role: str
    config: EngineConfig
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class RankHost:
    def __init__(self, config: EngineConfig, role: str, instance_id: str, rank: int = 0, tp_size: int = 1,
                 tp_address: TPRendezvous | str | None = None, host: str = "127.0.0.1", kv_timeout_s: float = 10.0,
                 model_config=None, weights=None, on_loop_death=None, client_ttl_s: float = 30.0,
                 kv_same_device: bool = True, kv_checksum: bool = False,
                 tp_listener: socket.socket | None = None, kv_transport: str = DEFAULT_TRANSPORT):
        """`on_loop_death`: called if the step loop dies (a Ray actor exits, so the instance is
        seen dead and its requests retried elsewhere, instead of hanging alive but idle).
        `kv_same_device`: KV between ranks on one device is written straight into the decode
        cache (the spec's kv_transport "auto"); False: always over the data channel ("torch").
        `kv_checksum`: every KV part carries a checksum, checked on receipt (the spec's kv_checksum).
        `kv_transport`: the KV transport's name in kvtransfer/registry.py (the spec's).
        `tp_address`, `tp_listener`: the TP group's rendezvous, and rank 0's socket for it (open_rendezvous)."""
        if role not in ROLES:
            raise ValueError(f"unknown instance role {role!r}: one of {', '.join(ROLES)}")
        self.role, self.instance_id, self.rank, self.host = role, instance_id, rank, host
        self.on_loop_death = on_loop_death
        self.sender = self.receiver = None
        self.kv_same_device_off: str | None = None  # why kv_same_device was asked for and is off here
        self._stop = threading.Event()
        self._flip: _Flip | None = None  # a role flip asked for (`flip`): the loop rebuilds, then goes on
        # NOTE: everything that runs the model, its load included, runs on this one thread. An
        # OpenMP team belongs to the thread that started it, and libgomp keeps it while that thread
        # lives: a model built on the caller's thread (a Ray actor's pool thread) left a second team
        # behind, and with more OpenMP threads than cores libgomp stops spinning between parallel
        # regions. Served steps ran ~30% slower than the same steps offline (docs/engine.md).
        built: list[BaseException | None] = []
        ready = threading.Event()

        def build_then_loop():
            try:
                self._build(config, role, instance_id, rank, tp_size, tp_address, host, kv_timeout_s, model_config,
                            weights, client_ttl_s, kv_same_device, kv_checksum, tp_listener, kv_transport)
                built.append(None)
            except BaseException as exc:  # raised again on the caller's thread
                built.append(exc)
            ready.set()
            if built[0] is None:
                self._loop()

        self._thread = threading.Thread(target=build_then_loop, daemon=True, name=f"{role}-rank{rank}")
        self._thread.start()
        ready.wait()
        if built[0] is not None:
            raise built[0]

    def _build(self, config, role, instance_id, rank, tp_size, tp_address, host, kv_timeout_s, model_config,
               weights, client_ttl_s, kv_same_device, kv_checksum, tp_listener=None,
               kv_transport: str = DEFAULT_TRANSPORT) -> None:
        """The model runner (joining the TP group), the KV transport end and the worker."""
        tp = TPGroup()
        if tp_size > 1:
            tp = join_tp_group(select_device(config.device), rank, tp_size, tp_address, tp_listener)
        self.runner = ModelRunner(config, tp, model_config=model_config, weights=weights)
        mc = self.runner.model_config
        # the KV cache's dtype, not the model's: an fp8 cache ships fp8, and refuses a peer whose cache is not
        compat = CompatRecord(model=mc.name, dtype=str(self.runner.kv_dtype).removeprefix("torch."),
                              num_layers=mc.kv_layout.num_slabs, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                              block_size=self.runner.block_size, tp_size=tp_size, device_type=self.runner.device.type,
                              kv_layout=mc.kv_layout.signature, kv_checksum=kv_checksum, kv_format=mc.kv_format,
                              trailer_format=trailer_format(rows_signature(config.speculative or config.ship_proposer_rows,
                                                                           mc, self.runner.dtype, self.runner.kv_dtype)))
        self._compat, self._kv_same_device = compat, kv_same_device
        self._setting = RankSetting(config, instance_id, rank, tp_size, host, kv_timeout_s, kv_transport,
                                    kv_same_device, client_ttl_s, text=rank == 0 and model_config is None)
        self._build_role(role, config)

    def _build_role(self, role: str, config: EngineConfig) -> None:
        """The role's KV transport end and worker over the runner (at start, and at a flip)."""
        backend, role_of = self.runner.backend, ROLES[role]
        kv_views, kv_same_device = None, self._kv_same_device
        if backend.own_kv_layout and role_of.moves_kv:  # the transfer reads and writes through them
            kv_views = backend.kv_views
            if kv_same_device:  # same-device writes copy torch's layout into the decode's blocks
                self.kv_same_device_off = (f"the {backend.name} attention backend lays out its own KV blocks "
                                           f"(attention_backend torch keeps torch's layout)")
                logger.warning("KV same-device transport off: %s; KV goes over the data channel",
                               self.kv_same_device_off)
            kv_same_device = False
        setting = replace(self._setting, config=config, kv_same_device=kv_same_device)
        built = role_of.build(self.runner, self._compat, kv_views, setting)
        self.role, self.worker, self.sender, self.receiver = role, built.worker, built.sender, built.receiver

    @property
    def step_thread_id(self) -> int:
        """The kernel's id of the thread that builds and steps the model."""
        return self._thread.native_id

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block this rank's engine uses."""
        return self.runner.block_size

    @property
    def engine(self) -> dict[str, str]:
        """What this rank's engine chose at load, for /status: dtype, linear layers (method and
        kernels, with layer counts), attention backend and KV cache dtype; a decode rank's speculative decoding."""
        r = self.runner
        return {"dtype": str(r.dtype).removeprefix("torch."), "linear_layers": r.linear_layers,
                "attention": r.backend.name, "kv_cache_dtype": str(r.kv_dtype).removeprefix("torch."),
                **self.worker.describe()}

    def assert_no_leaks(self) -> None:
        """Tests: every block of this instance's KV allocator is free (rank 0 owns it)."""
        self.worker.assert_no_leaks()

    def kv_endpoint(self) -> KVEndpoint | None:
        if self.receiver is None:
            return None
        host, port = self.receiver.endpoint_address
        return KVEndpoint(self.instance_id, self.rank, host, port)

    def _loop(self) -> None:
        try:
            while True:
                self.worker.run(self._stop)  # rank 0 drives, the others follow (engine/runner/worker_base.py)
                if self._flip is None:
                    return
                self._rebuild(self._flip)
        except Exception:  # a dead loop must be loud, and must not leave a live-looking instance
            logger.exception("%s rank %d loop died", self.instance_id, self.rank)
            if self.on_loop_death is not None:
                self.on_loop_death()

    def flip(self, role: str, config: EngineConfig, timeout_s: float = 60.0) -> None:
        """Changes the rank's role in place, keeping its model (weights, compiled kernels, KV pool): its
        loop stops, its KV ends and worker go, the new role's are built over the same runner on the loop's
        thread (with `config`'s scheduler, the new role's), and the loop goes on. The instance must be drained
        first: requests still here are dropped with the old worker. Ranks > 0 are asked first; their
        loops end when rank 0's stops (the owner asks every rank: cluster/control/flip.py).
        Raises RuntimeError when the rebuild failed or took over `timeout_s` (the rank is then dead)."""
        flip = self._flip if self._flip is not None and self._flip.role == role else self.expect_flip(role, config)
        if self.rank == 0:
            self._stop.set()  # (its loop releases the followers as it ends)
        if not flip.done.wait(timeout_s):
            raise RuntimeError(f"{self.instance_id} rank {self.rank}: the flip to {role} took over {timeout_s:g} s")
        if flip.error is not None:
            raise RuntimeError(f"{self.instance_id} rank {self.rank}: the flip to {role} failed: {flip.error}")

    def expect_flip(self, role: str, config: EngineConfig) -> _Flip:
        """Ranks > 0, before rank 0 flips: when rank 0's loop releases this one's, it rebuilds as `role`."""
        if role not in ROLES:
            raise ValueError(f"unknown instance role {role!r}: one of {', '.join(ROLES)}")
        self._flip = _Flip(role, config)
        return self._flip

    def _rebuild(self, flip: _Flip) -> None:
        """On the loop's thread: the old role's ends and worker closed, the runner's per-request state
        dropped, the new role built; the flip's waiter told (the error too, then re-raised)."""
        try:
            for end in (self.sender, self.receiver):
                if end is not None:
                    end.close()
            self.worker.close()
            self.runner.requests.clear()  # (a drained instance holds none; a dropped one's go)
            # the runner's settings stay (device, threads, cache, graphs); the new role's scheduler applies
            self._build_role(flip.role, replace(self._setting.config, scheduler=flip.config.scheduler))
            logger.info("%s rank %d: now %s", self.instance_id, self.rank, flip.role)
        except BaseException as exc:
            flip.error = exc
            raise
        finally:
            self._flip = None
            self._stop.clear()
            flip.done.set()

    def wait_stopped(self, timeout_s: float) -> bool:
        """Whether the rank's loop ended within `timeout_s` (a follower's ends when rank 0 stops)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        if self.rank == 0:
            self._thread.join(timeout=5)
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
        self.worker.close()
