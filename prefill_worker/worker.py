"""One rank of a prefill instance.

Rank 0 is the driver: it takes requests, schedules prefill batches, broadcasts each step to
the other ranks, samples first tokens and reports them. Every rank computes its share of the
heads and ships its own KV heads to the decode ranks that need them, layer by layer, through
its KV connector (kvtransfer/connector.py): right after layer i computes, the request's K/V of
that layer are gathered (a copy) and queued, and sent while the next layers compute.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from engine.block_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outbox import Outbox
from engine.request import Request
from kvtransfer.connector import PrefillConnector, Shipment
from kvtransfer.params import KVTransferParams
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
    more_choices: tuple = ()  # n > 1: the other choices' (first token, logprobs or None)


class PrefillWorker:
    def __init__(self, runner: ModelRunner, connector: PrefillConnector, instance_id: str = "prefill-0",
                 client_ttl_s: float = 30.0):
        """`client_ttl_s`: a client (router) silent for this long is gone; its requests are aborted.
        A request that failed to ship is reported failed, so the router retries it."""
        self.runner, self.connector, self.instance_id = runner, connector, instance_id
        self.tp = runner.tp
        mc = runner.model_config
        self.scheduler: PrefillScheduler | None = None
        if self.tp.rank == 0:
            kv = KVCacheManager(runner.num_blocks, runner.block_size, runner.config.cache.enable_prefix_caching,
                                runner.model_config.kv_layout.windows)
            self.scheduler = PrefillScheduler(runner.config.scheduler, kv, runner.max_model_len)
        self._inbox: queue.Queue = queue.Queue()
        self._outbox = Outbox()  # results per client (router): each gateway gets only its own
        self.client_ttl_s = client_ttl_s
        self.num_orphans_aborted = 0  # requests of clients that went silent
        # cumulative, for the autoscaler's online profile: tokens computed and seconds spent doing it
        self.num_computed_tokens, self.busy_s = 0, 0.0
        self.eos_token_ids = frozenset(mc.eos_token_ids)  # min_tokens holds them back (the model's one EOS set)

    # -- driver API (rank 0; thread-safe) -----------------------------------------------------
    def submit(self, req: Request, params: KVTransferParams) -> None:
        req.eos_token_ids = self.eos_token_ids
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
        s, sender = self.scheduler, self.connector.sender
        st = sender.stats
        return {"queued_prefill_tokens": float(s.num_queued_tokens), "waiting": float(len(s.waiting)),
                "running": float(len(s.running)), "kv_usage": s.kv.usage,
                "kv_bytes_sent": float(st.get("bytes_sent", 0)), "kv_transfer_seconds": sender.transfer_seconds,
                "kv_transfer_failures": float(st.get("groups_failed", 0) + st.get("parts_rejected", 0)),
                "prefill_tokens_computed": float(self.num_computed_tokens), "prefill_busy_s": self.busy_s,
                "orphans_aborted": float(self.num_orphans_aborted),
                "intraop_threads": float(self.runner.intraop_threads)}  # rank 0's, now (engine/threads.py)

    def has_work(self) -> bool:
        return not self._inbox.empty() or self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Rank 0: one prefill step (with TP, the followers run it too)."""
        self._drain_inbox()
        self._release_delivered()
        sched = self.scheduler.schedule()
        shipments = self.connector.shipments(sched, self.scheduler.kv.get_block_ids, self.runner.block_size,
                                             self.runner.device)
        self.runner.update_states(sched)
        inp = None if sched.is_empty else self.runner.prepare_inputs(sched)
        self.tp.broadcast_step((inp, shipments))
        if inp is None:
            return
        start = time.monotonic()
        logits = self._execute(inp, shipments)
        result = self.runner.sample(inp, logits)
        self.busy_s += time.monotonic() - start
        self.num_computed_tokens += sched.total_num_scheduled_tokens
        for req, token in self.scheduler.update(sched, result):
            logprobs = result.logprobs.get(req.request_id)
            more = tuple(result.choices.get(req.request_id, ())[1:])  # n > 1: sampled from the same logits
            self.connector.finish(req.request_id, token, logprobs, more)
            self._report(PrefillResult(req.request_id, token, num_cached_tokens=req.num_cached_tokens,
                                       logprobs=logprobs, more_choices=more))

    def follow(self) -> bool:
        """Ranks > 0: run the step rank 0 broadcast. Returns False when told to stop."""
        msg = self.tp.broadcast_step(None)
        if msg == "stop":
            return False
        self._release_delivered()
        inp, shipments = msg
        if inp is not None:
            self._execute(inp, shipments)
            for s in shipments:
                self.connector.finish(s.request_id, -1)  # only rank 0 knows the first token
        return True

    def stop_followers(self) -> None:
        self.tp.broadcast_step("stop")

    def _execute(self, inp, shipments: list[Shipment]):
        self.connector.start(shipments)
        kv = self.runner.kv_cache
        return self.runner.execute_model(inp, (lambda i: self.connector.save_layer(i, kv)) if shipments else None)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, a, b = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self.connector.add(a.request_id, b)
                try:
                    self.scheduler.add_request(a)
                except ValueError as exc:
                    self.connector.drop(a.request_id)
                    self._report(PrefillResult(a.request_id, None, str(exc)))
            elif self.scheduler.abort(a):
                self.connector.drop(a)
                self._outbox.forget(a)

    def release_delivered(self) -> None:
        """Rank 0 while idle: frees the blocks of transfers that ended (no collective call)."""
        self._release_delivered()

    def _release_delivered(self) -> None:
        for request_id, error in self.connector.take_delivered():
            if self.scheduler is not None:
                self.scheduler.release(request_id)
            if error:
                logger.warning("request %s (rank %d): %s", request_id, self.tp.rank, error)
                if self.scheduler is not None:
                    self._report(PrefillResult(request_id, None, error))
            self._outbox.forget(request_id)
