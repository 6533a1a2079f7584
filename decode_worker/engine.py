"""A decode instance: the colocated engine, what it streams, and the worker that drives it on a rank.

`ColocatedEngine`: one instance that prefills and decodes (the baseline that disaggregation is
measured against), driven step by step.

`OutputProcessor` / `RequestOutput`: what a decode instance streams per step: each request's new token
ids and their extras (engine/core/extras.py: logprobs), no text.

Text (detokenization, stop strings) is the front end's (engine/text/tokenizer.py): a stop string found there
ends the request here by an abort. Every output says where its tokens stand in the request's output
(`start`), so a consumer joins streams from two instances without de-duplicating anything: a
disaggregated request's first token is the prefill's to hand over, and this instance's outputs of it
begin at position 1.

`DecodeWorker`: one rank of a decode instance. Rank 0 drives: it reserves blocks for requests that a
prefill instance will fill, runs the continuous-batching loop, and queues each step's new tokens for the
router's collector, which long-polls `poll_outputs` (one call per step at most, never one per token).
Every rank's KV connector (kvtransfer/connector.py) receives its heads; a request joins the batch only
when all ranks hold its complete KV. In colocated mode (`add_request`) rank 0 also prefills locally. The
loop that drives the ranks, and the per-client queue of outputs, are engine/runner/worker_base.py's.

Per step, with tensor parallelism:  rank 0 schedules -> broadcast(step) -> all ranks execute
-> all_gather(each rank's finished/failed transfers) -> rank 0 admits requests complete everywhere.
A failed load ends the request with `kv_load_failed` (the router retries it, or recomputes it here)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from engine.core import tracing

from decode_worker.scheduler import Scheduler
from engine.core.block_manager import KVCacheManager
from engine.core.config import EngineConfig, window_start
from engine.core.request import Handover, HandoverError, Request, RequestMessage, RequestStatus, SamplingParams
from engine.runner.host_arena import attach_tier
from engine.runner.model_runner import ModelRunner
from engine.runner.worker_base import BaseWorker
from engine.speculative.speculator import Speculator
from engine.text.tokenizer import Tokenizer
from kvtransfer.connector import DecodeConnector, PrefillConnector, prompt_slots
from kvtransfer.held import HeldKV
from kvtransfer.params import KVTransferParams, Reservation

logger = logging.getLogger(__name__)


class ColocatedEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        if tokenizer is None and runner is None:
            tokenizer = Tokenizer.from_path(config.model)
        self.tokenizer = tokenizer
        mc = self.runner.model_config
        block_size = self.runner.block_size
        # a sliding KV group frees the blocks its window left behind (KVCacheManager)
        self.kv = attach_tier(KVCacheManager(self.runner.num_blocks, block_size, config.cache.enable_prefix_caching,
                                             mc.kv_layout.windows), self.runner)
        self.max_model_len = self.runner.max_model_len
        # rank 0's: the draft runs there alone (the other ranks' runners took part in the profile)
        self.speculator = None if config.speculative is None or self.runner.tp.rank > 0 else \
            Speculator.build(config.speculative, self.runner)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.speculator,
                                   kv_delta=config.cache.kv_delta, vocab_size=mc.vocab_size)
        self.output = OutputProcessor()  # token ids only: text is the front end's (engine/text/tokenizer.py)
        self.eos_token_ids = frozenset(mc.eos_token_ids)  # the model's one EOS set (ModelConfig)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        req = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_ids)
        self.scheduler.add_request(req)
        self.output.add_request(request_id)
        return req

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends a request here (`status` FINISHED_STOPPED: its front end found a stop string)."""
        self.scheduler.finish_request(request_id, status)
        self.output.abort(request_id)

    def take_forks(self) -> list[tuple[str, list[Request]]]:
        """Requests forked into their n choices since the last call (the outputs now follow the
        choices); (parent id, choices)."""
        forks = self.scheduler.take_forks()
        for parent_id, children in forks:
            self.output.fork(parent_id, children)
        return forks

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        tier = self.kv.tier
        if sched.is_empty and sched.kv_tier is not None:  # nothing to compute: the tiers' copies alone,
            self.runner.host_arena.apply(sched.kv_tier)  # then a while for the disk reads waited for
            tier.arrived([self.runner.poll_tier(wait_s=0.05)])
            return []
        if sched.is_empty and self.scheduler.has_unfinished() and not self.scheduler.running:
            raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting prompt")
        result = self.runner.execute(sched)
        if tier is not None:
            tier.arrived([self.runner.poll_tier()])
        touched = self.scheduler.update(sched, result)
        self.take_forks()
        return self.output.process(touched)


@dataclass(frozen=True)
class RequestOutput:
    """One step's news of one request, streamed to its router: immutable once made."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    start: int = 0  # the position of new_token_ids[0] in the request's output (of the next token, if none)
    error: str | None = None
    new_extras: list[dict] | None = None  # one per new token, when the request asked (carried unread)
    # with the first token of a prompt computed here (start 0): its tokens served from the prefix cache
    num_cached_tokens: int | None = None
    kv_load_failed: bool = False  # the error is a failed KV transfer (the router may recompute here)
    timings: dict | None = None  # with the end: seconds of its phases here, kv_transfer and decode (router PHASES)
    num_preemptions: int = 0  # with the end: how often it was preempted here (recomputed)


class OutputProcessor:
    """Per request, how many of its output tokens were handed over already (by this instance's outputs
    or, for the first token of a remote-prefilled request, by the prefill instance)."""

    def __init__(self):
        self.num_sent: dict[str, int] = {}

    def add_request(self, request_id: str, num_handed_over: int = 0) -> None:
        """`num_handed_over`: output tokens another instance streams (1: the prefill's first token)."""
        self.num_sent[request_id] = num_handed_over

    def fork(self, parent_id: str, children: list[Request]) -> None:
        """A request became its n choices (Scheduler._fork): each streams its own tokens from where
        the parent stood (each choice's first token is handed over as the parent's was)."""
        num = self.num_sent.pop(parent_id, 0)
        for child in children:
            self.num_sent[child.request_id] = num

    def process(self, reqs: list[Request]) -> list[RequestOutput]:
        """The outputs of this step for the requests that got a token or finished."""
        outputs = []
        for req in reqs:
            start = self.num_sent.get(req.request_id)
            if start is None:
                continue
            new_ids = req.output_token_ids[start:]
            extras = None
            if req.sampling_params.wants_extras:
                extras = req.output_extras[start:]
                assert len(extras) == len(new_ids), (req.request_id, len(extras), len(new_ids))
            self.num_sent[req.request_id] = req.num_output_tokens
            cached = req.num_cached_tokens if start == 0 and new_ids else None
            outputs.append(RequestOutput(req.request_id, new_ids, req.is_finished, req.status.finish_reason, start,
                                         new_extras=extras, num_cached_tokens=cached))
            if req.is_finished:
                del self.num_sent[req.request_id]
        return outputs

    def abort(self, request_id: str) -> None:
        self.num_sent.pop(request_id, None)


@dataclass
class _Phases:
    """When a request's phases here began (time.time_ns()): reserved (its KV awaited), or added
    (colocated: prefilled here); its KV complete; and its trace ("": not traced)."""
    trace: str
    since_ns: int
    kv_ns: int = 0
    colocated: bool = False

    def kv_complete(self, done, kv_bytes: int, instance_id: str, receiver: str = "", error: str | None = None) -> None:
        """Its KV is all here (or failed): the wait's span, and (from `done`, its begin's context:
        the prefill's kv.transfer) the receive's: `kv_bytes` its prompt's KV over the instance's ranks
        (what arrived, unless a sliding window shipped fewer tokens), `receiver` the transport's end."""
        self.kv_ns = time.time_ns()
        if not self.trace:
            return
        tracing.record("decode", "decode.kv_wait", self.trace, self.since_ns, self.kv_ns,
                       {"pdserve.instance": instance_id}, error)
        if done is not None and done.trace:
            tracing.record("decode", "kv.receive", done.trace, done.began_ns or self.kv_ns, self.kv_ns, {
                "pdserve.instance": instance_id, "pdserve.kv_bytes": kv_bytes, "pdserve.receiver": receiver})

    def finished(self, req: Request, instance_id: str) -> dict[str, float]:
        """It ended here: its phases' seconds and (traced) its decode's span."""
        now, start = time.time_ns(), self.kv_ns or self.since_ns
        if self.trace:
            tracing.record("decode", "decode", self.trace, start, now, {
                "pdserve.instance": instance_id, "pdserve.request_id": req.request_id,
                "pdserve.output_tokens": req.num_output_tokens, "pdserve.preemptions": req.num_preemptions,
                "pdserve.finish_reason": req.status.finish_reason, "pdserve.prefilled_here": self.colocated})
        kv = {} if self.colocated else {"kv_transfer": ((self.kv_ns or now) - self.since_ns) / 1e9}
        return {**kv, "decode": (now - start) / 1e9}


class DecodeWorker(BaseWorker):
    def __init__(self, engine: ColocatedEngine, connector: DecodeConnector, instance_id: str = "decode-0",
                 client_ttl_s: float = 30.0, holder: PrefillConnector | None = None):
        """`client_ttl_s`: a client (router) that has not polled for this long is gone; its
        requests are aborted. `holder`: this rank's sender end for KV its cache holds that another
        instance fetches (ship_held: kvtransfer/held.py; None: it ships none)."""
        super().__init__(engine.runner, instance_id, client_ttl_s)
        self.engine, self.connector = engine, connector
        mc = engine.runner.model_config
        self.held = None if holder is None else HeldKV(holder, mc.num_layers, mc.kv_layout.num_groups,
                                                       engine.runner.device, instance_id, from_tiers=False)
        if engine.kv.tier is not None:  # reservations evict what the transfer writes at once (engine/core/host_tier.py)
            engine.kv.tier.write_through()
        self._lock = threading.Lock()
        # while a step is in flight its requests' blocks stay theirs: an abort then frees them after it
        self._stepping, self._deferred_aborts = False, []
        # cumulative, for the autoscaler's online profile: steps, their seconds, sequences in them
        self.num_steps, self.step_s, self.num_step_seqs = 0, 0.0, 0
        self.num_bad_handovers = 0  # requests failed for a malformed handover (engine/core/request.py)
        self.num_reused_tokens = 0  # remote prompts' tokens its prefix cache held: not shipped (reserve)
        self._phases: dict[str, _Phases] = {}  # rank 0, under the lock: each request's, until it ends
        # a token's KV over the instance's ranks: a kv.receive span's bytes (a window ships fewer tokens)
        runner = engine.runner
        self._token_bytes = runner.kv_cache.nbytes // (runner.num_blocks * runner.block_size) * self.tp.size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv(self):
        return self.engine.kv

    def describe(self) -> dict[str, str]:
        spec = self.engine.speculator
        return {} if spec is None else {"speculative": spec.describe()}

    def close(self) -> None:
        if self.held is not None:
            self.held.connector.close()

    def set_followers(self, followers) -> None:
        """Rank 0 of tp > 1: the other ranks (`expect`, `forget`), so reservations reach every rank."""
        self.connector.set_followers(followers)

    @property
    def receiving(self):
        """This rank's end for KV that arrives (every remote prompt's)."""
        return self.connector

    # -- rank 0 API (thread-safe) ---------------------------------------------------------------
    def reserve(self, msg: RequestMessage, prefill_tp: int) -> Reservation | None:
        """Admission control: blocks for the prompt, or None. Registers the expected KV on all ranks:
        the prompt's tokens after those this instance's prefix cache holds (Reservation)."""
        req = Request.from_message(msg, self.engine.eos_token_ids)
        with self._lock:
            if not self.engine.scheduler.reserve(req):
                return None
            self.outbox.add(req.request_id, req.client_id)
            self.engine.output.add_request(req.request_id, num_handed_over=1)  # the prefill streams the first token
            # the tokens a decode step can still read: blocks wholly before them are null (reserve)
            n, kv, cached = req.num_prompt_tokens, self.engine.kv, req.num_cached_tokens
            slots = [prompt_slots(table, self.engine.runner.block_size, n, start=max(window_start(n, window), cached))
                     for table, window in zip(kv.get_block_ids(req.request_id), kv.windows)]
            self.connector.reserve(req.request_id, slots, prefill_tp)
            self.num_reused_tokens += cached
            self._phases[req.request_id] = _Phases(msg.trace_context, time.time_ns())
        return Reservation(cached)

    def ship_held(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> str | None:
        """Ships the KV of `token_ids` (whole blocks its prefix cache holds in its pool: a conversation's
        earlier turns, outputs included) from `params.decode_cached_tokens` on to `params.endpoints`,
        for another instance's fetch (issue 51 item 3); the next step carries it to every rank. Returns
        None once held, or why nothing is shipped."""
        if self.held is None:
            return f"{self.instance_id} ships no held KV"
        with self._lock:
            return self.held.hold(self.engine.kv, request_id, token_ids, params)

    def add_request(self, msg: RequestMessage) -> bool:
        """Colocated: prefill here too. False (nothing taken) while its class has no seat here
        (Scheduler.has_seat): the router keeps it queued."""
        with self._lock:
            if not self.engine.scheduler.has_seat(msg.sampling_params):
                return False
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params)
            self.outbox.add(msg.request_id, msg.client_id)
            self._phases[msg.request_id] = _Phases(msg.trace_context, time.time_ns(), colocated=True)
        return True

    def abort(self, request_id: str) -> None:
        """Its client gets nothing more from now on; its blocks are freed now or, while a step is in
        flight (it may be writing them), as that step ends, before a reservation could take them."""
        with self._lock:
            if self._stepping:
                self._deferred_aborts.append(request_id)
            else:
                self.engine.abort_request(request_id)
            self.outbox.forget(request_id)
            self.connector.cancel(request_id)
            self._phases.pop(request_id, None)

    def load(self) -> dict[str, float]:
        s = self.engine.scheduler
        rx = self.connector.receiver
        st = rx.stats if rx is not None else {}
        return {"running": float(len(s.running)), "waiting": float(len(s.waiting)),
                "reserved": float(len(s.remote)), "kv_usage": self.engine.kv.usage,
                "num_preemptions": float(s.num_preemptions), "kv_bytes_received": float(st.get("bytes_received", 0)),
                "kv_reused_prompt_tokens": float(self.num_reused_tokens),
                "kv_transfer_failures": float(st.get("failed", 0)),
                "kv_messages_dropped": float(st.get("garbage_messages", 0) + st.get("unknown_requests", 0)
                                             + self.num_bad_handovers),
                "kv_checksum_mismatches": float(st.get("kv_checksum_mismatches", 0)),
                "kv_mac_mismatches": float(st.get("kv_mac_mismatches", 0)),  # payloads failing their MAC
                "kv_peers_refused": float(st.get("auth_refused", 0)),  # failed the KV channel's authentication
                "decode_steps": float(self.num_steps),
                "decode_step_s": self.step_s, "decode_step_seqs": float(self.num_step_seqs),
                "kv_capacity_tokens": float((self.runner.num_blocks - 1) * self.runner.block_size),
                # what it shipped of its cache for other instances' fetches (kvtransfer/held.py)
                "kv_bytes_sent": float(self.held.connector.sender.stats.get("bytes_sent", 0)) if self.held else 0.0,
                **(self.engine.speculator.figures() if self.engine.speculator is not None else {}),
                **super().load()}

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Rank 0: one step. Returns whether a batch ran.

        The worker lock covers the scheduler's bookkeeping only: the runner's request table is this
        thread's, so its update (each new request's grammar: llguidance's tokenizer for the first one,
        a matcher fed the output so far for each choice and retry) and the inputs are made outside it,
        and reserve() never waits for them."""
        with self._lock:
            held = self._held_shipments()
            sched = self.engine.scheduler.schedule()
            if sched.is_empty and not self.connector.awaiting and not sched.finished_req_ids and not held \
                    and sched.kv_tier is None:
                return False  # idle: no collective call (followers wait on the control group)
            self._stepping = True
        try:
            runner = self.engine.runner
            runner.update_states(sched)
            inp = None if sched.is_empty else runner.prepare_inputs(sched)
            copies = sched.kv_tier if inp is None else None  # nothing to compute: the tiers' copies alone
            self.tp.broadcast_step((inp, held, copies))
            if copies is not None:
                runner.host_arena.apply(copies)
            if held:  # before the forward: the fetcher waits for no batch (it writes none of these blocks)
                self.held.ship(held, runner.kv_cache)
            result = None
            if inp is not None:
                start = time.monotonic()
                result = runner.sample(inp, runner.execute_model(inp))
                self.num_steps += 1
                self.step_s += time.monotonic() - start
                self.num_step_seqs += len(sched.new_requests) + len(sched.cached_requests)
            polls = self.tp.all_gather_object((self.connector.poll(), runner.poll_tier()))
        except BaseException:
            with self._lock:
                self._end_step()
            raise
        with self._lock:
            self._end_step()
            if self.engine.kv.tier is not None:
                self.engine.kv.tier.arrived([disk for _, disk in polls])
            outputs = self._admit_transfers([transfers for transfers, _ in polls])
            if result is not None:
                touched = self.engine.scheduler.update(sched, result)
                self._take_forks()
                outputs += self._process(touched)
        self._publish(outputs)
        return inp is not None

    def _end_step(self) -> None:
        """The step's writes are done: the aborts that came during it free their blocks now, and the
        blocks the host tier copied out in it are released (engine/core/host_tier.py)."""
        self._stepping = False
        if self.engine.kv.tier is not None:
            self.engine.kv.tier.release_copied()
        for request_id in self._deferred_aborts:
            self.engine.abort_request(request_id)
        self._deferred_aborts = []

    def follow(self) -> bool:
        """Ranks > 0: run the step rank 0 broadcast. Returns False when told to stop."""
        msg = self.tp.broadcast_step(None)
        if msg == "stop":
            return False
        inp, held, copies = msg
        runner = self.engine.runner
        if copies is not None:
            runner.host_arena.apply(copies)
        if held:
            self.held.ship(held, runner.kv_cache)
        if inp is not None:
            runner.execute_model(inp)
        if self.held is not None:
            self.held.connector.take_delivered()  # (rank 0 keeps the books)
        self.tp.all_gather_object((self.connector.poll(), runner.poll_tier()))
        return True

    def _held_shipments(self) -> list:
        """Rank 0, under the lock: frees the held blocks whose transfer ended; the shipments the next
        step carries."""
        if self.held is None:
            return []
        for request_id, error in self.held.connector.take_delivered():
            self.held.delivered(request_id, error)
        return self.held.take()

    def _admit_transfers(self, polls) -> list[RequestOutput]:
        """Requests whose KV is complete on every rank join the batch, with what the prefill handed
        over (engine/core/request.py); failed ones, and malformed handovers, end with an error."""
        touched = []
        ready, failed = self.connector.admit(polls)
        for done in ready:
            rid = done.request_id
            if (phases := self._phases.get(rid)) is not None:
                req = self.engine.scheduler.remote.get(rid)
                tokens = 0 if req is None else req.num_prompt_tokens - req.num_cached_tokens
                phases.kv_complete(done, tokens * self._token_bytes, self.instance_id,
                                   type(self.connector.receiver).__name__)
            try:
                handover = Handover.unpack(done.trailer)
            except HandoverError as exc:
                self.num_bad_handovers += 1
                logger.warning("%s: the handover of %s is malformed (%s): the request fails", self.instance_id, rid,
                               exc)
                failed[rid] = f"the prefill's handover is malformed: {exc}"
                continue
            req = self.engine.scheduler.remote.get(rid)
            if req is not None and req.sampling_params.wants_extras and handover.extras is None:
                failed[rid] = "the prefill sent the first token without the extras (logprobs) asked for"
                continue
            touched += self.engine.scheduler.remote_kv_ready(rid, handover.first_token, handover.extras,
                                                             handover.more_choices)
            proposer = self.engine.runner.draft
            if (handover.rows is not None and rid in self.engine.scheduler.requests
                    and hasattr(proposer, "receive_rows")):
                # its state of the prompt (engine/speculative/rows.py); not a forked n > 1's choices
                proposer.receive_rows(rid, *handover.rows, self.engine.kv.get_block_ids(rid)[0], req.all_token_ids)
        self._take_forks()
        outputs = self._process(touched)
        for request_id, reason in failed.items():
            if (phases := self._phases.pop(request_id, None)) is not None:
                phases.kv_complete(None, 0, self.instance_id, error=reason)
            if request_id in self.engine.scheduler.remote:
                self.engine.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
                self.engine.output.abort(request_id)
                outputs.append(RequestOutput(request_id, [], True, "error", error=reason, kv_load_failed=True))
        return outputs

    def _take_forks(self) -> None:
        """Requests forked into their n choices: each choice's outputs go to the parent's client."""
        for parent_id, children in self.engine.take_forks():
            client = self.outbox.client_of(parent_id)
            phases = self._phases.pop(parent_id, None)
            for child in children:
                self.outbox.add(child.request_id, client)
                if phases is not None:
                    self._phases[child.request_id] = replace(phases)
            self.outbox.forget(parent_id)

    def _process(self, touched: list[Request]) -> list[RequestOutput]:
        """The outputs of `touched`; a finished request's carries its phases' seconds here."""
        outputs = self.engine.output.process(touched)
        for i, o in enumerate(outputs):
            if o.finished and (phases := self._phases.pop(o.request_id, None)) is not None:
                req = next(r for r in touched if r.request_id == o.request_id)
                outputs[i] = replace(o, timings=phases.finished(req, self.instance_id),
                                     num_preemptions=req.num_preemptions)
        return outputs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.outbox.put(o.request_id, o, last=o.finished)
