"""The prefill instance's scheduler: prompts only, batched under a token budget.

A request's whole prompt is allocated at admission (after prefix-cache hits), so a prefill
never needs preemption; long prompts are then computed in chunks of the budget, and each
chunk's full blocks join the prefix cache in the step that computes them. The step that
computes a prompt's last chunk samples its first token. Prompts wait by priority class, then arrival.
The request keeps its blocks until its KV has been delivered (`release`), after which its full
blocks stay in the prefix cache.

A prompt whose prefix another instance holds may have that prefix's KV fetched instead (issue 51
item 3, docs/disaggregation.md "Cross-instance fetch"): `admit_fetch` allocates the whole prompt at
once and keeps it aside while the holder ships; `fetch_ended` puts it in line to compute the rest
(or, when the fetch failed, all that its own cache does not hold), ahead of prompts not yet admitted.

    schedule() -> SchedulerOutput -> runner -> RunnerOutput -> update() -> [(request, first_token)]"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig
from engine.core.priority import enqueue
from engine.core.request import (CachedRequestData, NewRequestData, Request, RequestStatus, RunnerOutput,
                                 SchedulerOutput, check_admission)
from engine.sample.sampling import history_of


@dataclass
class Fetch:
    """A prompt whose first `num_tokens` tokens' KV another instance ships into its blocks."""
    request: Request
    num_tokens: int
    opened: float  # time.monotonic() when it was admitted
    deadline: float  # past which it is given up and computed here


class PrefillScheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 vocab_size: int | None = None):
        self.config = config
        self.kv = kv
        self.max_model_len, self.vocab_size = max_model_len, vocab_size  # (check_admission's)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, prompt not finished
        self.done: dict[str, Request] = {}  # prompt finished, KV still being delivered
        self.fetching: dict[str, Fetch] = {}  # blocks allocated, a prefix's KV on its way from a holder
        self.fetched: deque[Request] = deque()  # the fetch ended: to compute from num_computed_tokens
        self._finished_ids: list[str] = []

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens not yet computed: the load figure routers balance on."""
        return (sum(r.num_tokens - r.num_computed_tokens for r in (*self.waiting, *self.running, *self.fetched))
                + sum(f.request.num_tokens - f.num_tokens for f in list(self.fetching.values())))

    @property
    def request_ids(self) -> set[str]:
        """The requests held here: waiting, fetching, running, or delivering their KV."""
        return {*(r.request_id for r in (*self.waiting, *self.running, *self.fetched)), *self.done, *self.fetching}

    def admit_fetch(self, req: Request, num_tokens: int, timeout_s: float) -> int | None:
        """Takes a prompt whose first `num_tokens` tokens' KV a holder is to ship: allocates all of
        its blocks now (the holder writes into them). Returns the first token the holder must ship
        from (those before it, this instance's prefix cache holds); None when there is nothing to
        fetch (its cache holds as much, or `num_tokens` leaves no token to compute) or no room (the
        caller then queues it with `add_request`). ValueError (check_admission) if it cannot be taken."""
        check_admission(req, self.max_model_len, self.request_ids, vocab_size=self.vocab_size)
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        if not num_hit < num_tokens < req.num_tokens or \
                self.kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_tokens_to_cache=num_hit) is None:
            self.kv.free(req)  # forget the hashes get_computed_blocks computed
            return None
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = req.num_cached_tokens = num_hit
        now = time.monotonic()
        self.fetching[req.request_id] = Fetch(req, num_tokens, now, now + timeout_s)
        return num_hit

    def fetch_ended(self, request_id: str, ok: bool) -> tuple[int, float]:
        """The fetch of `request_id` ended (`ok`: its KV is in the blocks; else none of it is
        trusted): the prompt goes in line to compute the rest. Returns (the tokens fetched, the
        seconds since it was admitted)."""
        f = self.fetching.pop(request_id, None)
        if f is None:
            return 0, 0.0
        fetched = 0
        if ok:
            fetched = f.num_tokens - f.request.num_computed_tokens
            f.request.num_computed_tokens = f.request.num_cached_tokens = f.num_tokens
            self.kv.cache_blocks(f.request, f.num_tokens)
        self.fetched.append(f.request)
        return fetched, time.monotonic() - f.opened

    def expired_fetches(self, now: float) -> list[str]:
        return [rid for rid, f in list(self.fetching.items()) if f.deadline < now]

    def add_request(self, req: Request) -> None:
        """Queues a prompt; ValueError (engine.core.request.check_admission) if it cannot be taken. An
        n > 1 request is one prompt here: every choice's first token comes from its logits."""
        check_admission(req, self.max_model_len, self.request_ids, vocab_size=self.vocab_size)
        enqueue(self.waiting, req)  # by class, then arrival (engine/core/priority.py)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.fetched)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is (a fetching one: after its fetch was cancelled on every
        rank); returns whether it was known."""
        if (f := self.fetching.pop(request_id, None)) is not None:
            self._free(f.request, RequestStatus.FINISHED_ABORTED)
            return True
        for pending in (self.waiting, self.running, self.fetched):
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
        if self.kv.tier is not None:
            self.kv.tier.forget(req.request_id)  # the disk reads it waited for, if any
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
        while self.fetched and budget > 0 and len(self.running) < self.config.max_num_seqs:
            budget -= self._start(self.fetched.popleft(), out, budget)
        reading = []  # prompts waiting for their blocks' disk reads (engine/core/host_tier.py): others go first
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            admitted = self._admit(self.waiting[0], out, budget)
            if admitted is None:
                reading.append(self.waiting.popleft())
                continue
            if not admitted:
                break
            budget -= len(out.new_requests[-1].token_ids)
            self.waiting.popleft()
        self.waiting.extendleft(reversed(reading))
        if self.kv.tier is not None and (not out.is_empty or self.kv.tier.busy):  # the tiers' copies, first
            out.kv_tier = self.kv.tier.take()  # (engine/core/host_tier.py; an empty step's: the worker makes them)
        return out

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> bool | None:
        """Whether `req` was admitted; None: it waits for its blocks' disk reads."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        tier = self.kv.tier
        reloaded = tier.claim_for(self.kv, req, num_hit) if tier is not None else []  # then host memory, disk
        if reloaded is None:
            self.kv.free(req)  # forget the hashes get_computed_blocks computed
            return None
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
        if tier is not None:
            tier.reload_for(self.kv, req, reloaded, num_pool_hit)  # (and the reads it waited for go)
        req.num_computed_tokens = req.num_cached_tokens = num_hit
        self._start(req, out, budget)
        return True

    def _start(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """A request with its blocks, from its num_computed_tokens: its first chunk runs in `out`
        (the runner learns of it there). Returns the chunk's tokens."""
        c = req.num_computed_tokens
        n = min(req.num_tokens - c, budget)
        self.kv.cache_blocks(req, c + n)
        req.status = RequestStatus.RUNNING
        out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids[c:c + n], c,
                                               self.kv.get_block_ids(req.request_id), req.sampling_params,
                                               sample=c + n == req.num_tokens, history=history_of(req)))
        self.running.append(req)
        return n

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
