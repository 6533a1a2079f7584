"""The router: places requests on (prefill, decode) pairs, streams their tokens, retries failures.

Lifecycle of one attempt (disaggregated):
    pick D, pick P  ->  D.reserve(prompt)  ->  P.submit(prompt, D's KV endpoints)
        (or P.fetch and a holder's ship_held, when another prefill holds its prefix: router/fetch.py)
    P's first token (position 0)  ->  client  (while the KV is still moving)
    D's tokens from position 1 (one long-poll per D per step, every request's tokens together)  ->  client
Each output names the position of its first token in the attempt's output, so the two streams join
without overlap; one that comes before the tokens ahead of it (D polled before P) waits for them.
On an error from P or D, or an instance found dead, the attempt is aborted on both and the
request is placed again (prompt + tokens already delivered as the new prompt) on instances that
have not failed it, up to `max_attempts`; then the client gets an error. Nobody hangs. A decode
instance whose KV load failed (`kv_load_failed`) instead recomputes the prompt itself when it is
at most `kv_recompute_max_tokens` long (vLLM's kv_load_failure_policy "recompute").

Locking: one lock guards the router's tables; it is never held across a call to an instance.
A placement decides under the lock (`_plan`), calls the instances without it (`_call`), then
settles under it again (`_settle`); an attempt failed or aborted meanwhile is undone there.
Calls that other code wants while holding the lock (aborts) are deferred until it is released.

No thread dies silently: a handler that raises (placing one request, one event of an instance)
fails only the request it was handling, with an explicit error, counted in `handler_errors`; what
escapes a thread's loop anyway is logged, counted and the loop restarted (router/supervisor.py).
"""
from __future__ import annotations

import logging
import math
import threading
import uuid
from dataclasses import dataclass, replace

from engine.core import tracing
from engine.core.request import RequestMessage, SamplingParams, choice_id
from kvtransfer.params import KVTransferParams
from router.client import DecodeClient, InstanceDeadError, PrefillClient
from router.failures import Failpoints, Failures
from router.fetch import Fetches, FetchPlan
from router.flow import QUEUE_TIMEOUT
from router.loads import count_placement, refresh_loads
from router.policy import BaseRoutingPolicy, SessionAffinity
from router.spans import decoding, first_token, open_attempt, placed
from router.tables import RequestStream, RouterTables, StreamEvent, Tracked, indexed
from router.supervisor import ThreadSupervisor

logger = logging.getLogger(__name__)

class QueueFullError(RuntimeError):
    """The router's admission queue is full: try again later (HTTP 429)."""


@dataclass
class _Plan:
    """One placement attempt, decided under the lock and carried out without it."""
    attempt_id: str
    msg: RequestMessage  # the attempt's, sent to both instances
    prefill: PrefillClient | None  # None: prefilled on the decode instance
    decodes: list[DecodeClient]  # candidates, policy's pick first
    fetch: FetchPlan | None = None  # the prompt's prefix fetched from another prefill instance


@dataclass
class _Outcome:
    decode: DecodeClient | None = None  # the instance that took the request (None: all full)
    dead: InstanceDeadError | None = None
    bad_request: str | None = None
    fetch: str | None = None  # how a planned fetch went: a counter's name (router/fetch.py)


class Router:
    def __init__(self, prefill: list[PrefillClient], decode: list[DecodeClient], policy: BaseRoutingPolicy,
                 mode: str = "disaggregated", disagg_threshold_tokens: int = 0, max_attempts: int = 3,
                 max_queued: int = 4096, poll_s: float = 0.2, kv_recompute_max_tokens: int = 0, kv_fetch: bool = True,
                 queue_timeout_s: float = math.inf, long_poll_s: float | None = None):
        """`max_queued`: requests of one priority class that may wait to be placed (more: QueueFullError);
        `queue_timeout_s`: how long one may wait (then "queue_timeout"). `long_poll_s` (default `poll_s`): a
        collector's wait for an idle instance's output; longer asks idle ones less, closes slower."""
        self.client_id = f"router-{uuid.uuid4().hex[:12]}"  # instances send this router only its own requests' outputs
        self.policy, self.mode, self.sessions = policy, mode, SessionAffinity()
        self.disagg_threshold_tokens, self.poll_s = disagg_threshold_tokens, poll_s
        self.long_poll_s = long_poll_s or poll_s
        self.failpoints = Failpoints.from_env()  # off unless PDSERVE_FAILPOINTS (router/failures.py)
        self.tables = t = RouterTables(prefill, decode, max_queued, queue_timeout_s)
        self.failures = Failures(t, max_attempts, kv_recompute_max_tokens, self.failpoints)
        # the tables under the names this class reads them by (the same objects)
        self.prefill, self.decode, self.stats, self.handler_errors = t.prefill, t.decode, t.stats, t.handler_errors
        self.fetches = Fetches(policy, t.prefill, t.decode, t.stats, enabled=kv_fetch)
        self._lock, self._wake, self._locked = t.lock, t.wake, t.locked
        self._live, self._by_attempt, self._pending, self._stopped = t.live, t.by_attempt, t.pending, t.stopped
        self._stop = threading.Event()
        self._supervisor = ThreadSupervisor(self._stop, backoff_s=poll_s)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for iid in [*self.decode, *self.prefill]:
            self._spawn(self._collect, iid)
        self._spawn(self._place_pending)
        self._spawn(self._refresh_loads)

    def _spawn(self, target, *args) -> None:
        self._supervisor.spawn(target.__name__.lstrip("_"), target, *args)

    @property
    def thread_restarts(self) -> dict[str, int]:
        """Thread kind (place_pending, collect, refresh_loads) -> restarts after it raised."""
        return self._supervisor.restarts

    @property
    def threads(self) -> list[threading.Thread]:
        """Every thread the router started (a collector's ends when its instance dies)."""
        return list(self._supervisor.threads)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        self._supervisor.join(timeout_s=2 * max(self.poll_s, self.long_poll_s) + 1)

    def add_instance(self, client: PrefillClient | DecodeClient) -> None:
        """A new instance joins while serving (placement starts using it at once)."""
        iid, role = client.info.instance_id, client.info.role
        with self._locked():
            (self.prefill if role == "prefill" else self.decode)[iid] = client
            self._wake.notify_all()
        if self._supervisor.threads:
            self._spawn(self._collect, iid)

    def drain(self, instance_id: str) -> None:
        """No new requests go to the instance; the ones it has run to completion."""
        with self._locked():
            client = self.tables.client(instance_id)
            if client is not None:
                client.info.draining = True

    def is_drained(self, instance_id: str) -> bool:
        """True when nothing needs the instance any more: no attempt decodes there, and every
        attempt it prefilled has its KV on the decode side."""
        with self._locked():
            return not any(t.decode_id == instance_id or (t.prefill_id == instance_id and not t.decoding)
                           or instance_id in t.placing for t in self._by_attempt.values())

    def mark_dead(self, instance_id: str, exc: Exception | None = None) -> None:
        """The instance died (its owner says so): every attempt on it is retried elsewhere."""
        self.failures.mark_dead(instance_id, exc)

    def remove_instance(self, instance_id: str) -> None:
        """An instance leaves while serving: nothing new goes there; its in-flight requests are
        retried elsewhere (as for a dead one), then it is forgotten."""
        self.failures.leave(instance_id)
        with self._locked():
            self.prefill.pop(instance_id, None)
            self.decode.pop(instance_id, None)
        self.policy.forget(instance_id)
        self.fetches.forget(instance_id)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               listener=None, session: str | None = None, trace: str = "", tenant: str = "",
               weight: float = 1.0) -> RequestStream | list[RequestStream]:
        """Starts a request; its tokens arrive on the returned stream (or at `listener`). With n > 1,
        a list of n streams, one per choice (events carry their `index`): the prompt is placed once,
        and each choice goes on by itself if that placement fails. A `session`'s request prefers the
        instances its last one ran on (SessionAffinity); its attempts' spans go under `trace` (engine/core/tracing.py).
        Queued, it waits by its class (params.priority), then its `tenant`'s fair share by `weight` (router/flow.py).
        Calls the chosen instances from the caller's thread (an event loop should call this from a worker)."""
        tracked = Tracked(request_id, list(prompt_token_ids), params, RequestStream(
            request_id, None if params.n > 1 else listener), session=session, trace=trace, tenant=tenant, weight=weight)
        if params.n > 1:
            tracked.choices = [Tracked(choice_id(request_id, i), tracked.prompt_token_ids,
                                       params.choice(i),
                                       RequestStream(choice_id(request_id, i), indexed(listener, i)), parent=tracked,
                                       index=i, grouped=True, trace=trace) for i in range(params.n)]
        with self._locked():
            if self._pending.full(params.priority):
                raise QueueFullError(f"{self._pending.size(params.priority)} requests of priority {params.priority} "
                                     "already queued")
            self.stats["submitted"] += 1
            self.stats["prompt_tokens"] += len(tracked.prompt_token_ids)
            self._live[request_id] = tracked  # (an n > 1 request: until its last choice ends)
            queue_behind = bool(self._pending)  # the queue decides who is placed next
            if queue_behind:
                self._pending.push(tracked)
                self._wake.notify_all()
        if not queue_behind and not self._place_guarded(tracked):
            with self._locked():
                self._pending.push(tracked)
        return [c.stream for c in tracked.choices] if tracked.choices else tracked.stream

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request wherever it is (queued, placing, prefilling,
        decoding). Never waits for an instance."""
        with self._locked():
            tracked = self._live.get(request_id)
            if tracked is None:
                return
            for t in [tracked, *tracked.choices]:
                if t in self._pending:
                    self._pending.remove(t)
                if self._by_attempt.get(t.attempt_id) is t:
                    self.tables.abort_attempt(t, "abort")
                self.tables.finish(t, StreamEvent([], True, "abort"))

    def stop(self, request_id: str, index: int, num_tokens: int) -> None:
        """The front end found a stop string in choice `index`'s text, completed by its output token
        `num_tokens` (1-based): the choice ends here with "stop" and is aborted on its instances. The
        tokens the router has or gets for it beyond that count as `tokens_past_stop`."""
        with self._locked():
            tracked = self._live.get(request_id)
            t = tracked.choices[index] if tracked is not None and tracked.choices else tracked
            if t is None or t.done:
                return
            self.stats["tokens_past_stop"] += max(0, len(t.delivered) - num_tokens)
            if t in self._pending:
                self._pending.remove(t)
            if self._by_attempt.get(t.attempt_id) is t:
                self._stopped[t.attempt_id] = None
                while len(self._stopped) > 1024:
                    del self._stopped[next(iter(self._stopped))]
                self.tables.abort_attempt(t, "stop")
            self._complete(t, "stop")

    @property
    def num_queued(self) -> int:
        """Requests waiting to be placed (admission, or a retry's turn)."""
        with self._locked():
            return len(self._pending)

    @property
    def num_placed(self) -> int:
        """Attempts on instances now."""
        with self._locked():
            return len(self._by_attempt)

    def snapshot(self) -> dict[str, float]:
        """The cumulative counters and the queue's length now (published for the autoscaler)."""
        with self._locked():
            return {**{k: float(v) for k, v in self.stats.items()}, "pending": float(len(self._pending))}

    @property
    def num_active(self) -> int:
        with self._locked():
            return len(self._by_attempt) + len(self._pending)

    # -- placement -------------------------------------------------------------------------------------
    def _healthy(self, pool: dict, tracked: Tracked) -> list:
        return [c.info for c in pool.values()
                if c.info.healthy and not c.info.draining and c.info.instance_id not in tracked.excluded]

    def _place_guarded(self, tracked: Tracked) -> bool:
        """`_place` (not under the lock), except that an exception fails this request alone (an
        explicit error) and returns True: it has ended."""
        try:
            self.failpoints.check("place")
            return self._place(tracked)
        except Exception as exc:
            with self._locked():
                self.failures.handler_failed("place", exc, tracked)
            return True

    def _place(self, tracked: Tracked) -> bool:
        """Tries to start an attempt now. Returns False when every decode instance is full (the
        caller queues the request; admission control), True when it started or ended."""
        with self._locked():
            plan = self._plan(tracked)
        if plan is None:
            return True
        outcome = self._call(plan)
        with self._locked():
            return self._settle(tracked, plan, outcome)

    def _plan(self, tracked: Tracked) -> _Plan | None:
        """Under the lock: picks the instances and registers the attempt (so its events are not
        dropped if they come before the calls return). None when the request has ended."""
        if tracked.done:
            return None
        decodes = self._healthy(self.decode, tracked)
        prefills = self._healthy(self.prefill, tracked)
        if not decodes:
            self.failures.give_up(tracked, "no healthy decode instance")
            return None
        prompt = tracked.prompt_token_ids + tracked.delivered
        done = len(tracked.delivered)  # the retry's prompt ends with them: its grammar and penalties count them
        params = replace(tracked.params, max_tokens=tracked.params.max_tokens - done,
                         min_tokens=max(0, tracked.params.min_tokens - done), num_resumed_tokens=done)
        tracked.base, tracked.decoding, tracked.held = len(tracked.delivered), False, []
        local = self.mode == "colocated" or not prefills or len(prompt) < self.disagg_threshold_tokens
        first = next((d for d in decodes if d.instance_id == tracked.recompute_on), None)
        local, tracked.recompute_on = local or first is not None, None
        sticky_p, sticky_d = self.sessions.last(None if tracked.attempt else tracked.session, prefills, decodes)
        salt = params.cache_salt  # (its blocks' hashes start from it: the policy looks them up so)
        first = first or sticky_d or self.policy.pick_decode(decodes, prompt, salt)  # once: a policy may keep state
        ordered = [self.decode[i.instance_id] for i in [first] + [d for d in decodes if d is not first]]
        picked = None if local else sticky_p or self.policy.pick_prefill(prefills, prompt, salt)
        prefill = None if picked is None else self.prefill[picked.instance_id]
        if not tracked.attempt and (reuse := self.policy.prefix_reuse(prompt, prefills if picked else decodes,
                                                                         picked or first, salt)) is not None:
            self.stats["prefix_available_tokens"] += reuse[0]  # what computes the prompt: available, routed
            self.stats["prefix_routed_tokens"] += reuse[1]
        tracked.prefill_id, tracked.decode_id = None if prefill is None else prefill.info.instance_id, None
        tracked.placing = tuple(c.info.instance_id for c in ([prefill] if prefill else []) + ordered)
        self._by_attempt[tracked.attempt_id] = tracked
        for choice in tracked.choices:  # the ids the decode instance gives them when it forks
            choice.prefill_id, choice.decode_id = None, None
            self._by_attempt[choice.attempt_id] = choice
        fetch = None if prefill is None else self.fetches.plan(prompt, prefills + decodes, prefill.info, salt)
        open_attempt(tracked, type(self.policy).__name__, None if prefill is None else prefill.info, first, local,
                     None if tracked.attempt else reuse, sticky_d is not None and first is sticky_d, fetch is not None)
        msg = RequestMessage(tracked.attempt_id, prompt, params, self.client_id, tracing.context_of(tracked.span))
        return _Plan(tracked.attempt_id, msg, prefill, ordered[:1] if local else ordered, fetch)

    def _call(self, plan: _Plan) -> _Outcome:
        """Without the lock: reserve on a decode instance and submit to the prefill instance (or
        add the request to the decode instance, prefilled there)."""
        msg, p, d = plan.msg, plan.prefill, None
        try:
            if p is None:
                d = plan.decodes[0]
                return _Outcome(d if d.add_request(msg) else None)  # (no seat: queued)
            for candidate in plan.decodes:
                reservation = candidate.reserve(msg, p.info.tp_size)
                if reservation is not None:
                    d = candidate
                    kv = KVTransferParams(msg.request_id, d.info.instance_id, d.info.tp_size, d.info.kv_endpoints,
                                          decode_cached_tokens=reservation.cached_tokens)
                    if plan.fetch is not None:
                        return _Outcome(d, fetch=self.fetches.start(plan.fetch, p, msg, kv))
                    p.submit(msg, kv)
                    return _Outcome(d)
            return _Outcome(None)
        except InstanceDeadError as exc:
            return _Outcome(d, dead=exc)
        except ValueError as exc:  # the request itself is bad (e.g. prompt too long)
            return _Outcome(d, bad_request=str(exc))

    def _settle(self, tracked: Tracked, plan: _Plan, outcome: _Outcome) -> bool:
        """Under the lock: records where the attempt runs, or undoes it if it was failed or
        aborted while the calls were out."""
        tracked.placing = ()
        if outcome.fetch is not None:
            self.stats[outcome.fetch] += 1
        if self._by_attempt.get(plan.attempt_id) is not tracked:
            for client in (plan.prefill, outcome.decode):
                if client is not None:
                    self.tables.deferred.append((client.abort, plan.attempt_id))
            return True
        tracked.decode_id = None if outcome.decode is None else outcome.decode.info.instance_id
        placed(tracked)
        for choice in tracked.choices:
            choice.decode_id = tracked.decode_id
        if outcome.dead is not None:
            iid = outcome.dead.instance_id
            tracked.excluded.add(iid)
            self.failures.mark_dead(iid, outcome.dead)  # fails this attempt too (it involves iid)
            if self._by_attempt.get(plan.attempt_id) is tracked:
                self.failures.fail(tracked, iid, str(outcome.dead))
        elif outcome.bad_request is not None:
            self.tables.abort_attempt(tracked, "bad_request", outcome.bad_request)
            self.failures.give_up(tracked, outcome.bad_request, bad_request=True)
        elif outcome.decode is None:  # every decode instance is full: the caller queues it
            tracked.end_span("no_room")
            del self._by_attempt[plan.attempt_id]
            for choice in tracked.choices:
                self._by_attempt.pop(choice.attempt_id, None)
            tracked.prefill_id = None
            return False
        else:
            count_placement(plan.prefill and plan.prefill.info, outcome.decode.info, len(plan.msg.prompt_token_ids),
                            plan.msg.sampling_params.max_tokens)
            if tracked.session and self.sessions.placed(tracked.session, tracked.prefill_id, tracked.decode_id):
                self.stats["session_placements"] += 1
            for client in (plan.prefill, outcome.decode):
                if client is not None and not client.info.healthy:  # died while the calls were out
                    self.failures.fail(tracked, client.info.instance_id, f"instance {client.info.instance_id} died")
                    break
        return True

    def _place_pending(self) -> None:
        """The placement thread: queued and retried requests, in the queue's order (router/flow.py).
        When the next fits nowhere, it goes back and the thread waits for capacity (a request
        finishing, an instance joining) or 50 ms. Requests queued too long fail ("queue_timeout")."""
        while not self._stop.is_set():
            with self._locked():
                for t in self._pending.expired():
                    self.stats["queue_timeouts"] += 1
                    self.failures.give_up(t, f"{QUEUE_TIMEOUT}: queued {self._pending.timeout_s:g} s, every decode "
                                             "instance full")
                entry = self._pending.pop()
                if entry is None:
                    self._wake.wait(0.05)
                    continue
            placed = False
            try:
                placed = self._place_guarded(entry.tracked)
            finally:
                if not placed:
                    with self._locked():
                        self._pending.restore(entry)
                        self._wake.wait(0.05)

    # -- events from instances -------------------------------------------------------------------------
    def _collect(self, iid: str) -> None:
        """One thread per instance client: long-polls its events while the router holds that client. Each
        goes to the handler of its kind (a prefill result carries `first_token`), not of the role the client
        had: a flip re-adds the instance with a new client, whose collector takes over once this one ends."""
        if (client := self.tables.client(iid)) is None:
            return  # removed before its collector started
        while not self._stop.is_set() and client.info.healthy:
            try:
                events = client.poll_outputs(self.long_poll_s, self.client_id)
            except InstanceDeadError as exc:
                if self.tables.client(iid) is client:  # (not an instance that came back as another)
                    self.failures.mark_dead(iid, exc)
                return
            except Exception:  # anything else must not end the thread: its streams would hang
                logger.exception("collecting from %s failed; polling again", iid)
                self._stop.wait(self.poll_s)
                continue
            with self._locked():
                firsts = [e for e in events if hasattr(e, "first_token")]
                self.failures.handle_events("prefill_result", self._on_prefill_result, firsts)
                self.failures.handle_events("decode_output", self._on_decode_output,
                                            [e for e in events if not hasattr(e, "first_token")])
                if self.tables.client(iid) is not client:
                    return  # removed, or flipped: a new client polls it

    def _on_prefill_result(self, r) -> None:
        tracked = self._by_attempt.get(r.request_id)
        if tracked is None:
            return
        if r.first_token is None:
            return self.failures.fail(tracked, tracked.prefill_id, r.error or "prefill failed")
        if tracked.attempt == 0:
            self.stats["cached_prompt_tokens"] += r.num_cached_tokens
        first_token(tracked, r.timings, r.num_cached_tokens)
        firsts = [(r.first_token, r.extras), *r.more_choices]
        for t, (token, extras) in zip(tracked.choices or [tracked], firsts):
            if not t.done:  # the first token of the attempt: position 0
                self._deliver(t, [token], None if extras is None else [extras], r.num_cached_tokens)
                self._release_held(t)

    def _release_held(self, tracked: Tracked) -> None:
        """Decode outputs that came before the prefill's first token go on now, in order."""
        held, tracked.held = sorted(tracked.held, key=lambda o: o.start), []
        for o in held:
            if self._by_attempt.get(o.request_id) is tracked:
                self._on_decode_output(o)

    def _on_decode_output(self, o) -> None:
        tracked = self._by_attempt.get(o.request_id)
        if tracked is None:
            if o.request_id in self._stopped:
                self.stats["tokens_past_stop"] += len(o.new_token_ids)
            return
        if o.error and o.kv_load_failed and self.failures.may_recompute(tracked):
            return self.failures.recompute(tracked, o.error)
        if o.error:
            return self.failures.fail(tracked, tracked.decode_id, o.error)
        if o.start > tracked.num_attempt_tokens:  # the prefill's first token has not come yet
            tracked.held.append(o)
            return
        decoding(tracked)
        if tracked.grouped and self._by_attempt.get(tracked.parent.attempt_id) is tracked.parent:
            self._by_attempt.pop(tracked.parent.attempt_id)  # forked: its choices go on, the KV is there
        if o.start < tracked.num_attempt_tokens:  # never from a sound instance: its streams do not overlap
            logger.error("request %s: %s sent tokens from position %d, %d are delivered; dropped",
                         tracked.request_id, tracked.decode_id, o.start, tracked.num_attempt_tokens)
            return
        if o.num_cached_tokens is not None and tracked.attempt == 0:  # a prompt computed here (colocated)
            self.stats["cached_prompt_tokens"] += o.num_cached_tokens
        self._deliver(tracked, o.new_token_ids, o.new_extras, o.num_cached_tokens)
        if o.finished:
            tracked.timings.update(o.timings or {})
            tracked.preemptions += o.num_preemptions
            del self._by_attempt[tracked.attempt_id]
            if tracked.prefill_id in self.prefill:
                self.tables.deferred.append((self.prefill[tracked.prefill_id].abort, tracked.attempt_id))
            self._complete(tracked, o.finish_reason)

    def _complete(self, tracked: Tracked, finish_reason: str) -> None:
        """The request (choice) ended well: counted, its stream ended."""
        self.stats["completed"] += 1
        self.stats["output_tokens"] += len(tracked.delivered)
        self.tables.finish(tracked, StreamEvent([], True, finish_reason))
        self._wake.notify_all()  # its blocks come free: queued requests may fit now

    def _deliver(self, tracked: Tracked, token_ids: list[int], extras: list[dict] | None = None,
                 num_cached_tokens: int | None = None) -> None:
        """`num_cached_tokens`: with an attempt's first token, its prompt tokens the prefix cache served."""
        if token_ids:
            tracked.delivered += token_ids
            tracked.stream.put(StreamEvent(list(token_ids), extras=extras, num_cached_tokens=num_cached_tokens))

    def _refresh_loads(self) -> None:
        refresh_loads(self)  # (router/loads.py: paced over many instances)
