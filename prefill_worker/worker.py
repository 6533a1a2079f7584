"""A prefill instance: its worker (one rank) and its scheduler.

`PrefillWorker`: one rank of a prefill instance.

Rank 0 is the driver: it takes requests, schedules prefill batches, broadcasts each step to
the other ranks, samples first tokens and reports them. Every rank computes its share of the
heads and ships its own KV heads to the decode ranks that need them, layer by layer, through
its KV connector (kvtransfer/connector.py): right after layer i computes, the request's K/V of
that layer are gathered (a copy) and queued, and sent while the next layers compute.
The loop that drives the ranks, and the per-client queue of results, are engine/runner/worker_base.py's.

`PrefillScheduler`: the prefill instance's scheduler: prompts only, batched under a token budget.

A request's whole prompt is allocated at admission (after prefix-cache hits), so a prefill
never needs preemption; long prompts are then computed in chunks of the budget, and each
chunk's full blocks join the prefix cache in the step that computes them. The step that
computes a prompt's last chunk samples its first token. The request keeps its blocks until
its KV has been delivered (`release`), after which its full blocks stay in the prefix cache.

    schedule() -> SchedulerOutput -> runner -> RunnerOutput -> update() -> [(request, first_token)]"""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.block_manager import Block, KVCacheManager, block_hashes
from engine.core.config import SchedulerConfig
from engine.core.request import (CachedRequestData, Handover, NewRequestData, Request, RequestMessage, RequestStatus,
                                 RunnerOutput, SchedulerOutput, check_admission)
from engine.runner.host_arena import attach_tier
from engine.runner.model_runner import ModelRunner
from engine.runner.worker_base import BaseWorker
from engine.sample.sampling import history_of
from engine.speculative.rows import DraftKVRecorder, RowRecorder
from kvtransfer.connector import PrefillConnector, Shipment, prompt_slots
from kvtransfer.params import KVTransferParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill instance streams its router per request: the first token, or why there is none."""

    request_id: str
    first_token: int | None  # None when the prefill failed
    error: str | None = None
    extras: dict | None = None  # the first token's (engine/core/extras.py), when the request asked for any
    num_cached_tokens: int = 0
    finished_at: float = field(default_factory=time.monotonic)
    more_choices: tuple = ()  # n > 1: the other choices' (first token, extras or None)


class PrefillWorker(BaseWorker):
    idle_wait_s = 0.002  # as its loop slept before the loop was shared (a decode: 1 ms)

    def __init__(self, runner: ModelRunner, connector: PrefillConnector, instance_id: str = "prefill-0",
                 client_ttl_s: float = 30.0):
        """`client_ttl_s`: a client (router) silent for this long is gone; its requests are aborted.
        A request that failed to ship is reported failed, so the router retries it."""
        super().__init__(runner, instance_id, client_ttl_s)
        self.connector = connector
        # a proposer on the decode instances that needs state of the prompt (a head's rows, a draft's
        # KV): rank 0 computes it and ships it with the prompt's KV (engine/speculative/rows.py)
        self.rows = runner.draft if isinstance(runner.draft, (RowRecorder, DraftKVRecorder)) else None
        if self.rows is not None:
            self.rows.observing = True
        mc = runner.model_config
        self.scheduler: PrefillScheduler | None = None
        if self.tp.rank == 0:
            kv = attach_tier(KVCacheManager(runner.num_blocks, runner.block_size,
                                            runner.config.cache.enable_prefix_caching, runner.model_config.kv_layout.windows),
                             runner)
            self.scheduler = PrefillScheduler(runner.config.scheduler, kv, runner.max_model_len)
        self._inbox: queue.Queue = queue.Queue()
        # held blocks shipped for another instance's fetch (ship_held), pinned until delivered
        self._ships: list[Shipment] = []
        self._shipping: dict[str, list[Block]] = {}
        # cumulative, for the autoscaler's online profile: tokens computed and seconds spent doing it
        self.num_computed_tokens, self.busy_s = 0, 0.0
        self.eos_token_ids = frozenset(mc.eos_token_ids)  # min_tokens holds them back (the model's one EOS set)

    # -- driver API (rank 0; thread-safe) -----------------------------------------------------
    def submit(self, msg: RequestMessage, params: KVTransferParams) -> None:
        """Queues a prompt; its first token (or why there is none) comes back through `poll_outputs`."""
        req = Request.from_message(msg, self.eos_token_ids)
        self.outbox.add(req.request_id, req.client_id)  # until its blocks are released
        self._inbox.put(("submit", req, params))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams, client_id: str = "") -> None:
        """Ships the KV of `token_ids` from `params.decode_cached_tokens` on to `params.endpoints`
        (another instance's fetch of a prefix this one holds: issue 51 item 3), from the blocks its
        prefix cache holds, without computing anything: `token_ids` are whole blocks, all held, or
        nothing is shipped and a PrefillResult with the error comes back through `poll_outputs`.
        Nothing comes back on success: the fetching side sees the KV arrive."""
        self.outbox.add(request_id, client_id)
        self._inbox.put(("ship", request_id, (list(token_ids), params)))

    def _report(self, result: PrefillResult) -> None:
        self.outbox.put(result.request_id, result)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def kv(self):
        return self.scheduler.kv

    def close(self) -> None:
        self.connector.close()

    def load(self) -> dict[str, float]:
        s, sender = self.scheduler, self.connector.sender
        st = sender.stats
        return {"queued_prefill_tokens": float(s.num_queued_tokens), "waiting": float(len(s.waiting)),
                "running": float(len(s.running)), "kv_usage": s.kv.usage,
                "kv_bytes_sent": float(st.get("bytes_sent", 0)), "kv_transfer_seconds": sender.transfer_seconds,
                "kv_transfer_failures": float(st.get("groups_failed", 0) + st.get("parts_rejected", 0)),
                "prefill_tokens_computed": float(self.num_computed_tokens), "prefill_busy_s": self.busy_s,
                **super().load()}

    def has_work(self) -> bool:
        return not self._inbox.empty() or self.scheduler.has_work() or bool(self._ships)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> bool:
        """Rank 0: one prefill step, when there is work (with TP, the followers run it too); without,
        it frees the blocks of transfers that ended and makes no collective call. Returns whether it stepped."""
        if not self.has_work():
            self._release_delivered()
            return False
        self._drain_inbox()
        self._release_delivered()
        sched = self.scheduler.schedule()
        shipments = self.connector.shipments(sched, self.scheduler.kv.get_block_ids, self.runner.block_size,
                                             self.runner.device)
        held, self._ships = self._ships, []
        self.runner.update_states(sched)
        inp = None if sched.is_empty else self.runner.prepare_inputs(sched)
        self.tp.broadcast_step((inp, shipments + held))
        if inp is None:
            self._ship(held)
            return True
        start = time.monotonic()
        logits = self._execute(inp, shipments + held)
        for s in held:
            self.connector.finish(s.request_id)
        result = self.runner.sample(inp, logits)
        self.busy_s += time.monotonic() - start
        self.num_computed_tokens += sched.total_num_scheduled_tokens
        for req, token in self.scheduler.update(sched, result):
            extras = result.extras.get(req.request_id)
            more = tuple(result.choices.get(req.request_id, ())[1:])  # n > 1: sampled from the same logits
            rid = req.request_id
            rows = None if self.rows is None else \
                self.rows.take(rid, self.scheduler.kv.get_block_ids(rid)[0], req.num_prompt_tokens)
            self.connector.finish(rid, Handover(token, extras, more, rows).pack())
            self._report(PrefillResult(req.request_id, token, num_cached_tokens=req.num_cached_tokens,
                                       extras=extras, more_choices=more))
        return True

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
                self.connector.finish(s.request_id)  # only rank 0 knows the first token: it hands it over
        else:
            self._ship(shipments)
        return True

    def _ship(self, shipments: list[Shipment]) -> None:
        """A step with nothing to compute: the held blocks' KV leaves, every layer (ship_held)."""
        if not shipments:
            return
        self.connector.start(shipments)
        kv = self.runner.kv_cache
        for layer in range(self.runner.model_config.num_layers):
            self.connector.save_layer(layer, kv)
        for s in shipments:
            self.connector.finish(s.request_id)

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
            if kind == "ship":
                self._plan_ship(a, *b)
            elif kind == "submit":
                self.connector.add(a.request_id, b)
                try:
                    self.scheduler.add_request(a)
                except ValueError as exc:
                    self.connector.drop(a.request_id)
                    self._report(PrefillResult(a.request_id, None, str(exc)))
            elif self.scheduler.abort(a):
                self.connector.drop(a)
                self.outbox.forget(a)
                if self.rows is not None:
                    self.rows.forget(a)

    def _plan_ship(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> None:
        """Pins the blocks of a ship_held request and queues its shipment for the next step, or
        reports why it cannot be shipped."""
        kv, size = self.scheduler.kv, self.runner.block_size
        why = None
        if self.runner.model_config.kv_layout.num_groups > 1:
            why = "a model of several KV groups (sliding windows) ships no held blocks"
        elif len(token_ids) % size or not params.decode_cached_tokens < len(token_ids):
            why = f"{len(token_ids)} tokens from {params.decode_cached_tokens}: not whole blocks of {size} past it"
        blocks = [] if why else [kv.block_pool.get_cached_block(h) for h in block_hashes(token_ids, size)]
        if not why and None in blocks:
            why = f"holds {blocks.index(None)} of the {len(blocks)} blocks"
        if why:
            self.outbox.put(request_id, PrefillResult(request_id, None, f"cannot ship the held prefix: {why}"), last=True)
            return
        kv.block_pool.touch(blocks)
        self._shipping[request_id] = blocks
        slots = prompt_slots([b.block_id for b in blocks], size, len(token_ids), self.runner.device,
                             params.decode_cached_tokens)
        self._ships.append(Shipment(request_id, params, len(token_ids) - params.decode_cached_tokens, slots))

    def _release_delivered(self) -> None:
        for request_id, error in self.connector.take_delivered():
            if (held := self._shipping.pop(request_id, None)) is not None:  # a ship_held: unpinned
                self.scheduler.kv.block_pool.free_blocks(held)
                self.outbox.put(request_id, PrefillResult(request_id, None, error), last=True) if error else \
                    self.outbox.forget(request_id)
                continue
            if self.scheduler is not None:
                self.scheduler.release(request_id)
            if error:
                logger.warning("request %s (rank %d): %s", request_id, self.tp.rank, error)
                if self.scheduler is not None:
                    self._report(PrefillResult(request_id, None, error))
            self.outbox.forget(request_id)


class PrefillScheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, prompt not finished
        self.done: dict[str, Request] = {}  # prompt finished, KV still being delivered
        self._finished_ids: list[str] = []

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens not yet computed: the load figure routers balance on."""
        return sum(r.num_tokens - r.num_computed_tokens for r in list(self.waiting) + self.running)

    @property
    def request_ids(self) -> set[str]:
        """The requests held here: waiting, running, or delivering their KV."""
        return {*(r.request_id for r in (*self.waiting, *self.running)), *self.done}

    def add_request(self, req: Request) -> None:
        """Queues a prompt; ValueError (engine.core.request.check_admission) if it cannot be taken. An
        n > 1 request is one prompt here: every choice's first token comes from its logits."""
        check_admission(req, self.max_model_len, self.request_ids)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is; returns whether it was known."""
        for pending in (self.waiting, self.running):
            for req in pending:
                if req.request_id == request_id:
                    pending.remove(req)
                    self._free(req, RequestStatus.FINISHED_ABORTED)
                    return True
        if request_id in self.done:
            self.release(request_id)
            return True
        return False

    def release(self, request_id: str) -> None:
        """The request's KV is delivered (or given up on): free its blocks into the prefix cache."""
        req = self.done.pop(request_id, None)
        if req is not None:
            self._free(req, RequestStatus.FINISHED_STOPPED)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self._finished_ids.append(req.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        if self.kv.tier is not None:  # the last step has ended: the blocks it reloaded are the requests' alone
            self.kv.tier.release_copied()
        budget = self.config.max_num_batched_tokens
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self.kv.cache_blocks(req, req.num_computed_tokens + n)  # computed in this step
            out.cached_requests.append(CachedRequestData(
                req.request_id, req.prompt_token_ids[req.num_computed_tokens:req.num_computed_tokens + n],
                req.num_computed_tokens, (), sample=req.num_computed_tokens + n == req.num_tokens))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], out, budget):
                break
            budget -= len(out.new_requests[-1].token_ids)
            self.waiting.popleft()
        if self.kv.tier is not None and not out.is_empty:  # the host tier's copies, before the forward
            out.kv_offloads, out.kv_reloads = self.kv.tier.take()  # (engine/core/host_tier.py; none runs empty)
        return out

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> bool:
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        tier = self.kv.tier
        reloaded = tier.claim_for(self.kv, req, num_hit) if tier is not None else []  # then from host memory
        num_pool_hit, num_hit = num_hit, num_hit + len(reloaded) * self.kv.block_size
        n = min(req.num_tokens - num_hit, budget)
        # Blocks enter the prefix cache chunk by chunk, as their KV gets computed: an abort
        # mid-prompt must not leave hashed blocks holding no KV.
        if self.kv.allocate_slots(req, req.num_tokens - num_pool_hit, hit_blocks,
                                  num_tokens_to_cache=num_hit + n) is None:
            self.kv.free(req)  # forget the hashes get_computed_blocks computed
            if reloaded:
                tier.release(reloaded)
            return False
        if reloaded:
            tier.reload_for(self.kv, req, reloaded, num_pool_hit)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_cached_tokens = num_hit
        out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids[num_hit:num_hit + n], num_hit,
                                               self.kv.get_block_ids(req.request_id), req.sampling_params,
                                               sample=num_hit + n == req.num_tokens, history=history_of(req)))
        self.running.append(req)
        return True

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, int]]:
        """Advances computed counts; returns the requests whose prompt finished, with first tokens."""
        by_id = {r.request_id: r for r in self.running}
        finished = []
        for r in sched.new_requests + sched.cached_requests:
            req = by_id.get(r.request_id)
            if req is None:  # aborted meanwhile
                continue
            req.num_computed_tokens += len(r.token_ids)
            token = result.sampled_token_ids.get(r.request_id)
            if token is not None:
                self.running.remove(req)
                self.done[req.request_id] = req
                finished.append((req, token))
        return finished
