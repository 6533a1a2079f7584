"""The prefill instance's scheduler: prompts only, batched under a token budget.

A request's whole prompt is allocated at admission (after prefix-cache hits), so a prefill
never needs preemption; long prompts are then computed in chunks of the budget, and each
chunk's full blocks join the prefix cache in the step that computes them. The step that
computes a prompt's last chunk samples its first token. The request keeps its blocks until
its KV has been delivered (`release`), after which its full blocks stay in the prefix cache.

    schedule() -> SchedulerOutput -> runner -> RunnerOutput -> update() -> [(request, first_token)]
"""
from __future__ import annotations

from collections import deque

from engine.core.batch import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig
from engine.core.request import Request, RequestStatus, check_admission
from engine.sample.logits_processing import history_of


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
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
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
        if self.kv.tier is not None:  # the host tier's copies, before the forward (engine/core/host_tier.py)
            out.kv_offloads, out.kv_reloads = self.kv.tier.take()
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
