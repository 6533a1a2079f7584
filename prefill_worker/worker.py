"""One rank of a prefill instance.

Rank 0 is the driver: it takes requests, schedules prefill batches, broadcasts each step to
the other ranks, samples first tokens and reports them. Every rank computes its share of the
heads and ships its own KV heads to the decode ranks that need them, layer by layer: right
after layer i computes, the request's K/V of that layer are gathered (a copy) and queued on
the sender, whose background thread sends while the next layers compute.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outbox import Outbox
from engine.request import Request
from kvtransfer.base import KVSender
from kvtransfer.params import KVTransferParams, kv_heads_of_rank
from kvtransfer.plan import plan_head_slices
from prefill_worker.scheduler import PrefillScheduler

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    request_id: str
    first_token: int | None  # None when the prefill failed
    error: str | None = None
    logprobs: dict[int, float] | None = None  # the first token's, when the request asked for them
    num_cached_tokens: int = 0
    finished_at: float = field(default_factory=time.monotonic)


@dataclass
class _Shipment:
    """The KV a step must ship for one request whose prompt completes in that step."""
    request_id: str
    params: KVTransferParams
    num_tokens: int
    slots: torch.Tensor  # (num_tokens,) this instance's slots of the prompt, logical order


class PrefillWorker:
    def __init__(self, runner: ModelRunner, sender: KVSender, instance_id: str = "prefill-0", lease_s: float = 30.0,
                 client_ttl_s: float = 30.0):
        """`lease_s`: how long a finished prompt's blocks wait for the decode side's ack before they
        are freed anyway (and the request reported failed, so the router retries it).
        `client_ttl_s`: a client (router) silent for this long is gone; its requests are aborted."""
        self.runner, self.sender, self.instance_id, self.lease_s = runner, sender, instance_id, lease_s
        self.tp = runner.tp
        mc = runner.model_config
        self.my_heads = kv_heads_of_rank(mc.num_kv_heads, self.tp.size, self.tp.rank)
        self.scheduler: PrefillScheduler | None = None
        if self.tp.rank == 0:
            kv = KVCacheManager(runner.num_blocks, runner.block_size, runner.config.cache.enable_prefix_caching)
            max_len = min(mc.max_position_embeddings, (runner.num_blocks - 1) * runner.block_size)
            self.scheduler = PrefillScheduler(runner.config.scheduler, kv, max_len)
        self._params: dict[str, KVTransferParams] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._outbox = Outbox()  # results per client (router): each gateway gets only its own
        self.client_ttl_s = client_ttl_s
        self.num_orphans_aborted = 0  # requests of clients that went silent
        self._delivered: queue.Queue[tuple[str, str | None]] = queue.Queue()  # (request id, error)
        self._watch: queue.Queue = queue.Queue()
        self._open: dict[str, list] = {}  # request id -> its transfers of the running step
        # cumulative, for the autoscaler's online profile: tokens computed and seconds spent doing it
        self.num_computed_tokens, self.busy_s = 0, 0.0
        threading.Thread(target=self._watch_transfers, daemon=True, name="kv-ack").start()

    # -- driver API (rank 0; thread-safe) -----------------------------------------------------
    def submit(self, req: Request, params: KVTransferParams) -> None:
        self._outbox.add(req.request_id, req.client_id)  # until its blocks are released
        self._inbox.put(("submit", req, params))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def poll_results(self, timeout: float = 0.0, client_id: str = "") -> list[PrefillResult]:
        """First tokens (or failures) of `client_id`'s requests since its last call; waits up to
        `timeout` for the first."""
        return self._outbox.take(client_id, timeout)

    def abort_silent_clients(self) -> list[str]:
        """Aborts the requests of clients that have not polled for `client_ttl_s` (their gateway
        died); returns their ids."""
        orphans = self._outbox.drop_silent(self.client_ttl_s)
        for rid in orphans:
            self.abort(rid)
        self.num_orphans_aborted += len(orphans)
        return orphans

    def _report(self, result: PrefillResult) -> None:
        self._outbox.put(result.request_id, result)

    def load(self) -> dict[str, float]:
        s, st = self.scheduler, self.sender.stats
        return {"queued_prefill_tokens": float(s.num_queued_tokens), "waiting": float(len(s.waiting)),
                "running": float(len(s.running)), "kv_usage": s.kv.usage,
                "kv_bytes_sent": float(st.get("bytes_sent", 0)), "kv_transfer_seconds": self.sender.transfer_seconds,
                "kv_transfer_failures": float(st.get("groups_failed", 0) + st.get("parts_rejected", 0)),
                "prefill_tokens_computed": float(self.num_computed_tokens), "prefill_busy_s": self.busy_s,
                "orphans_aborted": float(self.num_orphans_aborted)}

    def has_work(self) -> bool:
        return not self._inbox.empty() or self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Rank 0: one prefill step (a no-op broadcast when idle, so followers stay in step)."""
        self._drain_inbox()
        self._release_delivered()
        sched = self.scheduler.schedule()
        shipments = self._shipments(sched)
        self.runner.update_states(sched)
        inp = None if sched.is_empty else self.runner.prepare_inputs(sched)
        self.tp.broadcast_object((inp, shipments))
        if inp is None:
            return
        start = time.monotonic()
        logits = self._execute(inp, shipments)
        result = self.runner.sample(inp, logits)
        self.busy_s += time.monotonic() - start
        self.num_computed_tokens += sched.total_num_scheduled_tokens
        for req, token in self.scheduler.update(sched, result):
            logprobs = result.logprobs.get(req.request_id)
            self._finish_shipment(req.request_id, token, logprobs)
            self._report(PrefillResult(req.request_id, token, num_cached_tokens=req.num_cached_tokens,
                                            logprobs=logprobs))

    def follow(self) -> bool:
        """Ranks > 0: run the step rank 0 broadcast. Returns False when told to stop."""
        msg = self.tp.broadcast_object(None)
        if msg == "stop":
            return False
        self._release_delivered()
        inp, shipments = msg
        if inp is not None:
            self._execute(inp, shipments)
            for s in shipments:
                self._finish_shipment(s.request_id, -1)  # only rank 0 knows the first token
        return True

    def stop_followers(self) -> None:
        self.tp.broadcast_object("stop")

    def _execute(self, inp, shipments: list[_Shipment]):
        transfers = {s.request_id: self._begin(s) for s in shipments}
        self._open.update(transfers)

        def ship_layer(layer: int) -> None:
            kv_layer = self.runner.kv_cache[layer]  # (2, num_blocks, block_size, kv_heads, head_dim)
            flat = kv_layer.view(2, -1, *kv_layer.shape[-2:])
            for s in shipments:
                gathered = flat.index_select(1, s.slots)  # (2, num_tokens, local kv_heads, head_dim)
                for head_start, head_end, transfer in transfers[s.request_id]:
                    lo = head_start - self.my_heads.start
                    transfer.send_layer(layer, gathered[:, :, lo:lo + head_end - head_start].contiguous())

        return self.runner.execute_model(inp, ship_layer if shipments else None)

    def _begin(self, s: _Shipment) -> list:
        """Opens one transfer per decode rank that needs heads this rank holds."""
        mc = self.runner.model_config
        out = []
        for hs in plan_head_slices(mc.num_kv_heads, self.tp.size, s.params.decode_tp_size):
            if hs.prefill_rank != self.tp.rank:
                continue
            dest = s.params.endpoints[hs.decode_rank]
            out.append((hs.head_start, hs.head_end,
                        self.sender.begin(s.request_id, dest, hs.head_start, hs.head_end, s.num_tokens)))
        return out

    def _finish_shipment(self, request_id: str, first_token: int, logprobs: dict[int, float] | None = None) -> None:
        transfers = self._open.pop(request_id, [])
        for *_, transfer in transfers:
            transfer.finish(first_token, logprobs)
        self._watch.put((request_id, [t for *_, t in transfers], time.monotonic() + self.lease_s))

    def _shipments(self, sched) -> list[_Shipment]:
        out = []
        for r in sched.new_requests + sched.cached_requests:
            if not r.sample:
                continue
            n = r.num_computed_tokens + len(r.token_ids)
            blocks = self.scheduler.kv.get_block_ids(r.request_id)
            bs = self.runner.block_size
            slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)], dtype=torch.int64,
                                 device=self.runner.device)
            out.append(_Shipment(r.request_id, self._params[r.request_id], n, slots))
        return out

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, a, b = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._params[a.request_id] = b
                try:
                    self.scheduler.add_request(a)
                except ValueError as exc:
                    self._report(PrefillResult(a.request_id, None, str(exc)))
            elif self.scheduler.abort(a):
                self._params.pop(a, None)
                self._outbox.forget(a)

    def _watch_transfers(self) -> None:
        """Waits for each request's transfers in order, each until its lease ends; reports delivery
        or failure."""
        while True:
            request_id, transfers, lease_end = self._watch.get()
            error = None
            for t in transfers:
                try:
                    t.wait(timeout=max(0.0, lease_end - time.monotonic()))
                except Exception as exc:  # TransferError (lease over), peer death: the router retries elsewhere
                    error = f"KV transfer failed: {exc}"
            self._delivered.put((request_id, error))

    def _release_delivered(self) -> None:
        while True:
            try:
                request_id, error = self._delivered.get_nowait()
            except queue.Empty:
                return
            if self.scheduler is not None:
                self.scheduler.release(request_id)
                self._params.pop(request_id, None)
            if error:
                logger.warning("request %s (rank %d): %s", request_id, self.tp.rank, error)
                if self.scheduler is not None:
                    self._report(PrefillResult(request_id, None, error))
            self._outbox.forget(request_id)
