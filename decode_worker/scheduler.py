"""Continuous-batching scheduler of a decode instance.

Colocated mode prefills and decodes here; in disaggregated mode a request is first *reserved*
(`reserve`: blocks for its prompt, or a refusal, which is admission control), waits in
WAITING_FOR_REMOTE_KVS while a prefill instance streams its KV in, and joins the running batch
only once its KV is complete (`remote_kv_ready`), so a slow transfer never blocks the batch.

Each step spends a token budget: running requests first (one token per decoding sequence, the
next chunk for a sequence still prefilling), then waiting requests, whose prompts are chunked
to fit. Prefix-cache hits skip their cached blocks. When blocks run out, the running request of the
lowest priority class admitted last is preempted: its blocks are freed and it is recomputed later.
Waiting requests go by class, then arrival; the most urgent one that waits (or whose reservation was
refused lately) takes seats and blocks from running requests of a lower class (engine/core/priority.py).

    schedule() -> SchedulerOutput -> runner.execute() -> RunnerOutput -> update()
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from engine.core.request import (CachedRequestData, NewRequestData, Request, RequestStatus, RunnerOutput,
                                 SamplingParams, SchedulerOutput, check_admission, choice_id)
from engine.core.block_manager import KVCacheManager
from engine.core.config import SchedulerConfig, window_start
from engine.core.priority import ROOM_WANTED_S, RoomWanted, by_class, enqueue
from engine.sample.sampling import history_of
from engine.speculative.base import SpecSequence

if TYPE_CHECKING:
    from engine.speculative.speculator import Speculator

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculator: Speculator | None = None, kv_delta: bool = True, vocab_size: int | None = None):
        """`speculator`: speculative decoding (engine/speculative): decoding sequences compute their
        last token and its drafts in one step, and keep the drafts the target agrees with. `kv_delta`:
        `reserve` takes a remote prompt's leading blocks from the prefix cache (CacheConfig.kv_delta)."""
        self.config, self.speculator, self.kv_delta = config, speculator, kv_delta
        self.kv = kv
        self.max_model_len, self.vocab_size = max_model_len, vocab_size  # (check_admission's)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.remote: dict[str, Request] = {}  # reserved, KV still arriving
        self._unknown_to_runner: set[str] = set()  # remote requests that joined the batch
        self._finished_ids: list[str] = []  # told to the runner on the next step
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) blocks of forked choices, made next step
        self.forks: list[tuple[str, list[Request]]] = []  # (parent id, its choices) since take_forks
        self.num_preemptions = 0
        self.preemptions_by_class: Counter[int] = Counter()  # priority -> preemptions of its requests
        self.wanted: dict[str, RoomWanted] = {}  # reservations refused while a lower class ran (make_room)
        self._speculating: list[tuple[Request, CachedRequestData, int]] = []  # this step's: slots for k drafts

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Colocated: queues a prompt to prefill here; ValueError (engine.core.request.check_admission) if it
        cannot be taken (its n choices run side by side once forked)."""
        check_admission(req, self.max_model_len, self.requests, self.config.max_num_seqs, self.vocab_size)
        self.requests[req.request_id] = req
        enqueue(self.waiting, req)

    def reserve(self, req: Request) -> bool:
        """Allocates blocks for a remote-prefilled prompt; False (and no change) if they don't fit,
        ValueError if it cannot be taken at all (as `add_request`). The leading blocks this
        instance's prefix cache holds are taken from it (`req.num_cached_tokens`: the prefill
        instance ships only the tokens after them; delta transfer), unless `kv_delta` is off."""
        check_admission(req, self.max_model_len, self.requests, self.config.max_num_seqs, self.vocab_size)
        if self._seats_taken() + req.sampling_params.n > self.config.max_num_seqs:
            return self._want_room(req)
        n, tier = req.num_prompt_tokens, self.kv.tier
        hits, num_hit = self.kv.get_computed_blocks(req) if self.kv_delta else (None, 0)
        # then the blocks the host tier holds, reloaded by the next step (before the request can join)
        # (host slots only: a reservation does not wait for disk reads)
        reloaded = tier.claim_for(self.kv, req, num_hit, from_disk=False) if tier is not None and self.kv_delta else []
        if any(window_start(n, w) > num_hit + len(reloaded) * self.kv.block_size for w in self.kv.windows):
            if reloaded:  # a window starts after the hits: its blocks before it would never be written
                tier.release(reloaded)
            hits, num_hit, reloaded = None, 0, []  # (the window's nulls instead)
        num_pool_hit, num_hit = num_hit, num_hit + len(reloaded) * self.kv.block_size
        # No prefix caching of the new blocks until their KV has arrived (see remote_kv_ready). With
        # a sliding window, none for the blocks before it: the prefill ships only what is read.
        num_null = None if num_hit else [window_start(n, w) // self.kv.block_size for w in self.kv.windows]
        with tier.paused() if tier is not None else contextlib.nullcontext():
            # what it evicts is not offloaded: the KV transfer may write those blocks before the next
            # step (a decode instance's tier writes through: they are in it already, or dropped)
            got = self.kv.allocate_slots(req, n - num_pool_hit, hits, num_tokens_to_cache=num_hit, contiguous=True,
                                         num_null_blocks=num_null)
        if got is None:
            if reloaded:
                tier.release(reloaded)
            self.kv.free(req)  # forget hashes it may have computed
            return self._want_room(req)
        self.wanted.pop(req.request_id, None)
        if reloaded:
            tier.reload_for(self.kv, req, reloaded, num_pool_hit)
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return True

    def has_seat(self, params: SamplingParams) -> bool:
        """Admission control of a prompt to prefill here: whether the requests of its class and the
        more urgent ones (running, reserved or waiting) leave its choices seats. Lower classes do
        not count: it goes ahead of them in line, and takes their seats (`_make_room`)."""
        taken = sum(r.sampling_params.n for r in (*self.running, *self.remote.values(), *self.waiting)
                    if r.priority <= params.priority)
        return taken + params.n <= self.config.max_num_seqs

    def _seats_taken(self) -> int:
        """Sequences running or reserved (a reservation's choices run side by side once forked)."""
        return len(self.running) + sum(r.sampling_params.n for r in self.remote.values())

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv.block_size) * len(self.kv.windows)

    def _want_room(self, req: Request) -> bool:
        """A refused reservation: False. While a lower class runs, the next step makes it room
        (`_make_room`), so the router's next try of it fits."""
        if any(r.priority > req.priority for r in self.running):
            self.wanted[req.request_id] = RoomWanted(req.priority, req.sampling_params.n,
                                                     self._blocks_for(req.num_tokens), time.monotonic() + ROOM_WANTED_S)
        return False

    def _make_room(self) -> None:
        """The most urgent waiting request, and the reservations refused lately (`wanted`), take
        seats and blocks from running requests of a lower class: the lowest class first, in it the
        last admitted. The room they free is theirs: waiting requests of a lower class stay out
        (`_schedule_waiting`) until the claim is met or lapses."""
        now = time.monotonic()
        self.wanted = {rid: w for rid, w in self.wanted.items() if w.until > now and rid not in self.requests}
        wants = list(self.wanted.values())
        if self.waiting and any(r.priority > self.waiting[0].priority for r in self.running):
            head = self.waiting[0]
            wants.append(RoomWanted(head.priority, 1, self._blocks_for(head.num_tokens), now))
        if not wants:  # (every step where no more urgent class waits)
            return
        seats, blocks = self._seats_taken(), 0
        self.running = by_class(self.running)
        for want in sorted(wants, key=lambda w: w.priority):
            seats, blocks = seats + want.seats, blocks + want.blocks
            while self.running and self.running[-1].priority > want.priority and \
                    (seats > self.config.max_num_seqs or blocks > self.kv.num_free_blocks):
                self._preempt(self.running.pop())
                seats -= 1

    def remote_kv_ready(self, request_id: str, first_token: int, extras: dict | None = None,
                        more_choices: tuple = ()) -> list[Request]:
        """The prompt's KV is in place and the prefill sampled `first_token` (with its `extras`, when
        the request asked for any; with n > 1, `more_choices` holds the other choices' (token,
        extras)): join the batch.

        Returns the requests that got a token (the n choices, forked), [] if it is no longer known."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return []
        n = req.num_computed_tokens = req.num_prompt_tokens
        # the KV is there now: cacheable, but for the block a window's cut starts inside (never filled before it)
        self.kv.cache_blocks(req, n, valid_from=[window_start(n, w) for w in self.kv.windows])
        if req.sampling_params.wants_extras:
            assert extras is not None, f"{request_id} asked for extras; its first token came without"
        if req.sampling_params.n > 1:
            assert len(more_choices) == req.sampling_params.n - 1, f"{request_id}: {len(more_choices) + 1} choices"
            return self._fork(req, [(first_token, extras), *more_choices])
        self._first_token(req, first_token, extras)
        return [req]

    def _first_token(self, req: Request, token: int, extras: dict | None) -> None:
        """A request whose prompt's KV is complete got its first token: it runs, or ends at once."""
        req.output_token_ids.append(token)
        if req.sampling_params.wants_extras:
            req.output_extras.append(extras)
        status = self._check_stop(req, token)
        if status is not None:
            self.finish_request(req.request_id, status)
            return
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._unknown_to_runner.add(req.request_id)

    def _fork(self, parent: Request, choices: list[tuple[int, dict | None]]) -> list[Request]:
        """n > 1: the prompt's KV, computed once, becomes each choice's (`choices`: its first token
        and extras). Choice 0 takes the parent's blocks; the others share its full blocks and copy its
        partial last one (KVCacheManager.fork; the runner copies before the next step). A choice that
        finds no free block for its copy waits, preempted (recomputed, from its prefix-cache hits)."""
        sp, pid = parent.sampling_params, parent.request_id
        ids = [choice_id(pid, i) for i in range(sp.n)]
        self.requests.pop(pid)
        self._finished_ids.append(pid)  # the runner forgets the parent (colocated: it prefilled it)
        if self.speculator is not None:
            self.speculator.forget(pid)  # what a proposer kept of it (a head: its prompt's rows)
        children, no_room = [], set()
        for i in range(len(choices)):
            child = Request(ids[i], parent.prompt_token_ids,
                            sp.choice(i), parent.arrival_time,
                            parent.eos_token_ids, client_id=parent.client_id)
            child.num_computed_tokens, child.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens
            self.requests[child.request_id] = child
            children.append(child)
            if i == 0:
                self.kv.rename(pid, child.request_id)
            elif (copies := self.kv.fork(ids[0], child, parent.num_computed_tokens)) is not None:
                self.block_copies += copies
            else:
                no_room.add(i)
        for i, (child, (token, extras)) in enumerate(zip(children, choices)):
            self._first_token(child, token, extras)
            if i in no_room and child.status == RequestStatus.RUNNING:
                self.running.remove(child)
                self._preempt(child)
        self.forks.append((pid, children))
        return children

    def take_forks(self) -> list[tuple[str, list[Request]]]:
        """The requests forked into their n choices since the last call: (parent id, choices)."""
        forks, self.forks = self.forks, []
        return forks

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Ends a request (abort, or a stop found by the output processor) and frees its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.remote.pop(request_id, None)
        self._unknown_to_runner.discard(request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        if self.kv.tier is not None:
            self.kv.tier.forget(request_id)  # the disk reads it waited for, if any
        self._finished_ids.append(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids, block_copies=self.block_copies)
        self._finished_ids, self.block_copies = [], []
        if self.kv.tier is not None:  # the last step has ended: the blocks its copies held go
            self.kv.tier.release_copied()
        self._make_room()  # (before the speculator plans: it may preempt)
        ks = {} if self.speculator is None else \
            self.speculator.plan(self.running, self._unknown_to_runner, self.max_model_len)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, ks)
        if self._speculating:
            budget += self._propose()
        self._schedule_waiting(out, budget)
        if self.kv.tier is not None and (not out.is_empty or self.kv.tier.busy):  # the tiers' copies, first
            out.kv_tier = self.kv.tier.take()  # (engine/core/host_tier.py; an empty step's: the worker makes them)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, ks: dict[str, int]) -> int:
        """`ks`: speculating requests, id -> at most how many drafts (slots for them are taken here)."""
        scheduled: list[Request] = []
        self.running = by_class(self.running)  # the tail is preempted first: the lowest class's last admitted
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            k = max(0, min(ks.get(req.request_id, 0), budget - num_new))
            num_null = self.kv.drop_out_of_window(req)  # first: its blocks may make room
            new_blocks = self.kv.allocate_slots(req, num_new + k)
            if new_blocks is None and k:  # no room for drafts: a plain decode step
                k, new_blocks = 0, self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                victim = self.running.pop()  # the lowest class's last admitted
                self._preempt(victim)
                if victim is req:
                    break
                continue
            token_ids = req.all_token_ids[req.num_computed_tokens:req.num_computed_tokens + num_new]
            sample = req.num_computed_tokens + num_new == req.num_tokens
            if req.request_id in self._unknown_to_runner:  # remote-prefilled: first step here
                self._unknown_to_runner.discard(req.request_id)
                out.new_requests.append(NewRequestData(req.request_id, token_ids, req.num_computed_tokens,
                                                       self.kv.get_block_ids(req.request_id),
                                                       req.sampling_params, sample, history_of(req)))
            else:
                out.cached_requests.append(CachedRequestData(req.request_id, token_ids, req.num_computed_tokens,
                                                             tuple([b.block_id for b in g] for g in new_blocks), sample,
                                                             num_null))
                if k:
                    self._speculating.append((req, out.cached_requests[-1], k))
            scheduled.append(req)
            budget -= num_new + k
            i += 1
        return budget

    def _propose(self) -> int:
        """This step's drafts, appended to the speculating requests' tokens; the slots of drafts not
        proposed are freed. Returns the token budget they leave."""
        spec, self._speculating = self._speculating, []
        drafts = self.speculator.propose([SpecSequence(req.request_id, req.all_token_ids, k,
                                                       self.kv.get_block_ids(req.request_id)) for req, _, k in spec])
        unused = 0
        for (req, data, k), proposed in zip(spec, drafts):
            proposed = proposed[:k]
            data.token_ids, data.num_draft_tokens = data.token_ids + proposed, len(proposed)
            if len(proposed) < k:
                freed = self.kv.trim(req, req.num_computed_tokens + 1 + len(proposed))
                data.new_block_ids = tuple(new[:len(new) - len(f)] for new, f in zip(data.new_block_ids, freed))
                unused += k - len(proposed)
        return unused

    def _preempt(self, req: Request) -> None:
        self._unknown_to_runner.discard(req.request_id)
        self.kv.free(req)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)  # its blocks, and the draft's KV in them, are gone
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_class[req.priority] += 1
        enqueue(self.waiting, req, ahead=True)
        logger.debug("preempted %s (recompute later)", req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        reading = []  # prompts waiting for their blocks' disk reads (engine/core/host_tier.py): others go first
        claimed = min((w.priority for w in self.wanted.values()), default=None)  # room kept for a reservation
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if claimed is not None and req.priority > claimed:
                break
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            tier = self.kv.tier
            reloaded = tier.claim_for(self.kv, req, num_hit) if tier is not None else []  # then host memory, disk
            if reloaded is None:
                reading.append(self.waiting.popleft())
                continue
            num_pool_hit, num_hit = num_hit, num_hit + len(reloaded) * self.kv.block_size
            num_new = min(req.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(req, num_hit - num_pool_hit + num_new, hit_blocks)
            if new_blocks is None:
                if reloaded:
                    tier.release(reloaded)
                break
            if tier is not None:
                tier.reload_for(self.kv, req, reloaded, num_pool_hit)  # (and the reads it waited for go)
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            out.new_requests.append(NewRequestData(
                req.request_id, req.all_token_ids[num_hit:num_hit + num_new], num_hit,
                self.kv.get_block_ids(req.request_id), req.sampling_params,
                sample=num_hit + num_new == req.num_tokens, history=history_of(req)))
            budget -= num_new
        self.waiting.extendleft(reversed(reading))

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advances computed counts, appends sampled tokens, finishes requests that stop.

        Returns the requests that got a new token this step (finished ones included)."""
        touched = []
        for r in sched.new_requests + sched.cached_requests:
            req = self.requests.get(r.request_id)
            if req is None:  # aborted while its step ran
                continue
            if r.request_id in result.spec_token_ids:
                self._take_verified(req, r, result)
                touched.append(req)
                continue
            req.num_computed_tokens += len(r.token_ids)
            token = result.sampled_token_ids.get(r.request_id)
            if token is None:
                continue
            if req.sampling_params.n > 1:  # colocated: it prefilled here; its choices go on
                self.running.remove(req)
                touched += self._fork(req, result.choices[r.request_id])
                continue
            req.output_token_ids.append(token)
            if r.request_id in result.extras:
                req.output_extras.append(result.extras[r.request_id])
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
            touched.append(req)
        return touched

    def _take_verified(self, req: Request, r: CachedRequestData, result: RunnerOutput) -> None:
        """A speculating request's step: its kept drafts and the token after them join its output,
        up to a stop; the blocks past its computed tokens are freed (the rejected drafts' slots)."""
        tokens, extras = result.spec_token_ids[r.request_id], result.spec_extras.get(r.request_id)
        req.num_computed_tokens += len(r.token_ids) - r.num_draft_tokens + len(tokens) - 1
        self.speculator.record(r.num_draft_tokens, len(tokens) - 1)
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            if extras is not None:
                req.output_extras.append(extras[i])
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
                return
        self.kv.trim(req, req.num_computed_tokens)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens > sp.min_tokens:  # before, the sampler holds EOS and stop ids back
            if not sp.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_set:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
