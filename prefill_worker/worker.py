"""`PrefillWorker`: one rank of a prefill instance.

Rank 0 is the driver: it takes requests, schedules prefill batches, broadcasts each step to
the other ranks, samples first tokens and reports them. Every rank computes its share of the
heads and ships its own KV heads to the decode ranks that need them, layer by layer, through
its KV connector (kvtransfer/connector.py): right after layer i computes, the request's K/V of
that layer are gathered (a copy) and queued, and sent while the next layers compute.
The loop that drives the ranks, and the per-client queue of results, are engine/runner/worker_base.py's.

Every rank also receives, through its fetch connector (a DecodeConnector over a KV receiver), the KV
of a prompt prefix another instance holds and ships (`fetch` here, `ship_held` there: issue 51
item 3): rank 0 allocates the prompt's blocks and every rank expects those tokens before `fetch`
returns; each step while a fetch is open gathers the ranks' polls; a fetch that failed or passed its
deadline is computed here instead.

`PrefillScheduler` (scheduler.py): prompts only, batched under a token budget."""
from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace

from engine.core import tracing

from engine.core.block_manager import KVCacheManager
from engine.core.request import Handover, Request, RequestMessage
from engine.core.tier_copies import TierCopies
from engine.runner.host_arena import attach_tier
from engine.runner.model_runner import ModelRunner
from engine.runner.worker_base import BaseWorker
from engine.speculative.rows import DraftKVRecorder, RowRecorder
from kvtransfer.connector import DecodeConnector, PrefillConnector, Shipment, prompt_slots
from kvtransfer.held import HeldKV
from kvtransfer.params import KVTransferParams
from prefill_worker.fetch_cost import FetchCost
from prefill_worker.scheduler import PrefillScheduler

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
    timings: dict | None = None  # seconds of its phases here: prefill_queue, prefill (router/tables.py PHASES)


@dataclass
class _Phases:
    """When a request's phases here began (time.time_ns()), and its open kv.transfer span (traced)."""
    trace: str  # the router's attempt span's traceparent ("": not traced)
    arrived_ns: int
    started_ns: int = 0  # its first chunk was scheduled
    kv_span: object = None

    def first_token(self, req: Request, instance_id: str) -> dict[str, float]:
        """The prompt is computed: its phases' seconds, and (traced) their spans."""
        now = time.time_ns()
        started = self.started_ns or now
        if self.trace:
            attributes = {"pdserve.instance": instance_id, "pdserve.request_id": req.request_id}
            tracing.record("prefill", "prefill.queue", self.trace, self.arrived_ns, started, attributes)
            tracing.record("prefill", "prefill.compute", self.trace, started, now, {
                **attributes, "pdserve.prompt_tokens": req.num_prompt_tokens,
                "pdserve.cached_tokens": req.num_cached_tokens})
        return {"prefill_queue": (started - self.arrived_ns) / 1e9, "prefill": (now - started) / 1e9}


class PrefillWorker(BaseWorker):
    idle_wait_s = 0.002  # as its loop slept before the loop was shared (a decode: 1 ms)

    def __init__(self, runner: ModelRunner, connector: PrefillConnector, instance_id: str = "prefill-0",
                 client_ttl_s: float = 30.0, fetcher: DecodeConnector | None = None, fetch_timeout_s: float = 30.0):
        """`client_ttl_s`: a client (router) silent for this long is gone; its requests are aborted.
        A request that failed to ship is reported failed, so the router retries it. `fetcher`: this
        rank's end for KV fetched from other instances (None: it fetches none); a fetch not complete
        `fetch_timeout_s` after it began is given up and computed here."""
        super().__init__(runner, instance_id, client_ttl_s)
        self.connector = connector
        self.fetcher, self.fetch_timeout_s = fetcher, fetch_timeout_s
        # the fetches that brought their KV: their tokens and seconds from admission to the KV complete
        # (the router's yardstick against computing: fixed + per token, fitted); those given up on
        self.fetch_cost, self.num_fetches_failed = FetchCost(), 0
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
            self.scheduler = PrefillScheduler(runner.config.scheduler, kv, runner.max_model_len,
                                              runner.model_config.vocab_size)
        self._inbox: queue.Queue = queue.Queue()
        # blocks this instance holds, shipped for another instance's fetch (ship_held), held until delivered
        self.held = HeldKV(connector, mc.num_layers, mc.kv_layout.num_groups, runner.device, instance_id)
        # cumulative, for the autoscaler's online profile: tokens computed and seconds spent doing it
        self.num_computed_tokens, self.busy_s = 0, 0.0
        self.eos_token_ids = frozenset(mc.eos_token_ids)  # min_tokens holds them back (the model's one EOS set)
        self._phases: dict[str, _Phases] = {}  # rank 0: the requests taken, until their KV is delivered

    # -- driver API (rank 0; thread-safe) -----------------------------------------------------
    def submit(self, msg: RequestMessage, params: KVTransferParams) -> None:
        """Queues a prompt; its first token (or why there is none) comes back through `poll_outputs`."""
        req = Request.from_message(msg, self.eos_token_ids)
        self.outbox.add(req.request_id, req.client_id)  # until its blocks are released
        self._inbox.put(("submit", req, params))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def fetch(self, msg: RequestMessage, params: KVTransferParams, num_tokens: int, holder_tp: int,
              wait_s: float = 30.0) -> int | None:
        """Rank 0 (thread-safe): takes a prompt as `submit` does, the KV of its first `num_tokens`
        tokens to come from a holder (another instance's `ship_held`, `holder_tp` ranks). Returns
        once every rank expects it: the first token the holder must ship from (the ones before,
        this instance's cache holds), or None when this instance fetches nothing for it (no
        fetcher, nothing to gain, no room now, a refused prompt, no answer within `wait_s`): the
        prompt is then computed here as submitted (or refused through `poll_outputs`)."""
        if self.fetcher is None:
            self.submit(msg, params)
            return None
        req = Request.from_message(msg, self.eos_token_ids)
        self.outbox.add(req.request_id, req.client_id)
        # unanswered (a long step), the fetch may still open: it then ends at its deadline
        return self._ask("fetch", req, (params, num_tokens, holder_tp), wait_s, late=None)

    def give_up_fetch(self, request_id: str) -> None:
        """Rank 0 (thread-safe): the holder will not ship `request_id`'s KV (it said so): compute it."""
        self._inbox.put(("unfetch", request_id, None))

    def set_followers(self, followers) -> None:
        """Rank 0 of tp > 1: the other ranks (`expect`, `forget`), so fetches reach every rank's fetcher."""
        if self.fetcher is not None:
            self.fetcher.set_followers(followers)

    @property
    def receiving(self) -> DecodeConnector | None:
        """This rank's end for KV that arrives (a fetch's)."""
        return self.fetcher

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams,
                  wait_s: float = 30.0) -> str | None:
        """Rank 0 (thread-safe): ships the KV of `token_ids` from `params.decode_cached_tokens` on to
        `params.endpoints` (another instance's fetch of a prefix this one holds: issue 51 item 3),
        from the blocks its prefix cache holds (its tiers' reloaded first), computing nothing.
        Returns once they are held: None, the KV then on its way (the fetcher sees it arrive, or
        its transfer fail); else why nothing is shipped (`token_ids` not whole blocks, not all held,
        no answer within `wait_s`)."""
        # unanswered (a long step), it may still be held and ship: the fetcher has given up meanwhile
        return self._ask("ship", request_id, (list(token_ids), params), wait_s, late=f"not held within {wait_s:.0f} s")

    def _ask(self, kind: str, key, args: tuple, wait_s: float, late):
        """Queues `(kind, key, (*args, answer))` for the loop and returns its answer, or `late` when
        none comes within `wait_s`."""
        answer = Future()
        self._inbox.put((kind, key, (*args, answer)))
        try:
            return answer.result(wait_s)
        except FutureTimeout:
            return late

    @property
    def num_fetches(self) -> int:
        return self.fetch_cost.n

    @property
    def num_fetched_tokens(self) -> int:
        return int(self.fetch_cost.tokens)

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
                "kv_fetches": float(self.num_fetches), "kv_fetched_tokens": float(self.num_fetched_tokens),
                "kv_fetch_seconds": self.fetch_cost.seconds, **self.fetch_cost.figures(),
                "kv_fetches_failed": float(self.num_fetches_failed),
                "kv_fetch_bytes_received": float(self._fetch_stats().get("bytes_received", 0)),
                **super().load()}

    def _fetch_stats(self) -> dict:
        rx = None if self.fetcher is None else self.fetcher.receiver
        return {} if rx is None else rx.stats

    def has_work(self) -> bool:
        return (not self._inbox.empty() or self.scheduler.has_work() or self.held.busy
                or bool(self.scheduler.fetching) or (self.kv.tier is not None and self.kv.tier.busy))

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> bool:
        """Rank 0: one prefill step, when there is work (with TP, the followers run it too); without,
        it frees the blocks of transfers that ended and makes no collective call. Returns whether it stepped."""
        if not self.has_work():
            self._release_delivered()
            if self.kv.tier is not None:  # the blocks the last step reloaded (it ended: each rank steps in order)
                self.kv.tier.release_copied()
            return False
        self._drain_inbox()
        self._release_delivered()
        self.held.retry()  # holds whose disk reads landed: their reloads go with this step's copies
        sched = self.scheduler.schedule()
        self._started(sched)
        shipments = self.connector.shipments(sched, self.scheduler.kv.get_block_ids, self.runner.block_size,
                                             self.runner.device)
        held = self.held.take()
        self.runner.update_states(sched)
        inp = None if sched.is_empty else self.runner.prepare_inputs(sched)
        # a step with nothing to compute makes the tiers' copies itself (one that computes: in its forward)
        copies = sched.kv_tier if inp is None else None
        if copies is None and inp is None and held and self.kv.tier is not None:
            copies = self.kv.tier.take()
        fetching = bool(self.scheduler.fetching)
        reading = sched.kv_tier is not None and sched.kv_tier.poll  # disk reads in flight
        self.tp.broadcast_step((inp, shipments + held, (fetching, reading), copies))
        if fetching or reading:  # before the step: a fetch that ends now computes in the next
            polls = self.tp.all_gather_object(self._poll(fetching))
            if reading:
                self.kv.tier.arrived([disk for _, disk in polls])
            if fetching:
                self._end_fetches([fetched for fetched, _ in polls])
        if inp is None:
            self._ship(held, copies)
            return bool(held)  # waiting for a fetch alone, the loop sleeps between polls
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
            phases = self._phases.get(rid)
            self._report(PrefillResult(req.request_id, token, num_cached_tokens=req.num_cached_tokens,
                                       extras=extras, more_choices=more,
                                       timings=None if phases is None else phases.first_token(req, self.instance_id)))
        return True

    def follow(self) -> bool:
        """Ranks > 0: run the step rank 0 broadcast. Returns False when told to stop."""
        msg = self.tp.broadcast_step(None)
        if msg == "stop":
            return False
        self._release_delivered()
        inp, shipments, (fetching, reading), copies = msg
        if fetching or reading:
            self.tp.all_gather_object(self._poll(fetching))
        if inp is not None:
            self._execute(inp, shipments)
            for s in shipments:
                self.connector.finish(s.request_id)  # only rank 0 knows the first token: it hands it over
        else:
            self._ship(shipments, copies)
        return True

    def _poll(self, fetching: bool) -> tuple[list, list]:
        """This rank's (fetches' receipts, disk tier reads ended) for rank 0's books."""
        return self.fetcher.poll() if fetching else [], self.runner.poll_tier()

    def _ship(self, shipments: list[Shipment], copies: TierCopies | None = None) -> None:
        """A step with nothing to compute: the tiers' `copies` are made, then the held blocks' KV
        leaves, every layer (ship_held)."""
        if copies is not None:
            self.runner.host_arena.apply(copies)
        self.held.ship(shipments, self.runner.kv_cache)

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
                tokens, params, answer = b
                answer.set_result(self.held.hold(self.scheduler.kv, a, tokens, params))
            elif kind == "fetch":
                self._open_fetch(a, *b)
            elif kind == "unfetch":
                if a in self.scheduler.fetching:
                    self._fetch_failed(a, "the holder will not ship it")
            elif kind == "submit":
                self._take(a, b, lambda req=a: self.scheduler.add_request(req))
            else:
                self._abort(a)

    def _started(self, sched) -> None:
        """Rank 0: the requests whose first chunk this step computes leave the queue now."""
        for r in sched.new_requests:
            if (phases := self._phases.get(r.request_id)) is not None and not phases.started_ns:
                phases.started_ns = time.time_ns()

    def _ended(self, request_id: str, outcome: str, error: str | None = None) -> None:
        """Rank 0: the request leaves this instance (its KV delivered, failed, or aborted)."""
        if (phases := self._phases.pop(request_id, None)) is not None:
            tracing.end(phases.kv_span, attributes={"pdserve.outcome": outcome}, error=error)

    def _abort(self, request_id: str) -> None:
        self._ended(request_id, "aborted")
        if request_id in self.scheduler.fetching:
            self.fetcher.cancel(request_id)  # on every rank: nothing more lands in its blocks
        if self.scheduler.abort(request_id):
            self.connector.drop(request_id)
            self.outbox.forget(request_id)
            if self.rows is not None:
                self.rows.forget(request_id)

    def _take(self, req: Request, params: KVTransferParams, admit):
        """A prompt whose KV goes per `params`: `admit()`'s answer; one it refuses (ValueError,
        check_admission) is reported failed (None). Its phases start here (arrived when it was submitted); a
        traced one's KV transfer span opens, and its traceparent goes with every part (`begin`)."""
        phases = self._phases[req.request_id] = _Phases(
            req.trace_context, time.time_ns() - int((time.monotonic() - req.arrival_time) * 1e9))
        if req.trace_context:
            phases.kv_span = tracing.start("prefill", "kv.transfer", req.trace_context, attributes={
                "pdserve.instance": self.instance_id, "pdserve.decode_instance": params.decode_instance_id,
                "pdserve.decode_tp": params.decode_tp_size, "pdserve.decode_cached_tokens": params.decode_cached_tokens,
                "pdserve.sender": type(self.connector.sender).__name__})
            params = replace(params, trace_context=tracing.context_of(phases.kv_span))
        self.connector.add(req.request_id, params)
        try:
            return admit()
        except ValueError as exc:
            self._ended(req.request_id, "refused", str(exc))
            self.connector.drop(req.request_id)
            self._report(PrefillResult(req.request_id, None, str(exc)))
            return None

    def _open_fetch(self, req: Request, params: KVTransferParams, num_tokens: int, holder_tp: int,
                    answer: Future) -> None:
        """Admits a fetched prompt and has every rank expect the fetched tokens' KV (answering
        `fetch` with the first token to fetch); without room or gain, queues it as submitted (None)."""
        start = None
        try:
            start = self._take(req, params, lambda: self._expect_fetch(req, num_tokens, holder_tp))
        finally:
            answer.set_result(start)

    def _expect_fetch(self, req: Request, num_tokens: int, holder_tp: int) -> int | None:
        start = self.scheduler.admit_fetch(req, num_tokens, self.fetch_timeout_s)
        if start is None:
            self.scheduler.add_request(req)
            return None
        slots = prompt_slots(self.scheduler.kv.get_block_ids(req.request_id)[0], self.runner.block_size, num_tokens,
                             start=start)
        self.fetcher.reserve(req.request_id, [slots], holder_tp)
        return start

    def _end_fetches(self, polls: list) -> None:
        """Rank 0: the fetches every rank holds whole go on to compute the rest; failed and late ones
        compute all of it."""
        ready, failed = self.fetcher.admit(polls)
        for done in ready:
            self.fetch_cost.add(*self.scheduler.fetch_ended(done.request_id, True))
        for rid, why in failed.items():
            self._fetch_failed(rid, why, cancelled=True)
        for rid in self.scheduler.expired_fetches(time.monotonic()):
            self._fetch_failed(rid, f"no KV within {self.fetch_timeout_s:.0f} s")

    def _fetch_failed(self, request_id: str, why: str, cancelled: bool = False) -> None:
        if not cancelled:
            self.fetcher.cancel(request_id)
        self.scheduler.fetch_ended(request_id, False)
        self.num_fetches_failed += 1
        logger.info("%s: fetch of %s given up (%s): computing it", self.instance_id, request_id, why)

    def _release_delivered(self) -> None:
        for request_id, error in self.connector.take_delivered():
            if self.held.delivered(request_id, error):  # a ship_held's: its blocks let go
                continue
            if self.scheduler is not None:
                self.scheduler.release(request_id)
                self._ended(request_id, "failed" if error else "delivered", error)
            if error:
                logger.warning("request %s (rank %d): %s", request_id, self.tp.rank, error)
                if self.scheduler is not None:
                    self._report(PrefillResult(request_id, None, error))
            self.outbox.forget(request_id)
