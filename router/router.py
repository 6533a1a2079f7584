"""The router: places requests on (prefill, decode) pairs, streams their tokens, retries failures.

Lifecycle of one attempt (disaggregated):
    pick D, pick P  ->  D.reserve(prompt)  ->  P.submit(prompt, D's KV endpoints)
    P's first token  ->  client  (while the KV is still moving)
    D's tokens (one long-poll per D per step, every request's tokens together)  ->  client
On an error from P or D, or an instance found dead, the attempt is aborted on both and the
request is placed again (prompt + tokens already delivered as the new prompt) on instances that
have not failed it, up to `max_attempts`; then the client gets an error. Nobody hangs.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace

from engine.request import Request, SamplingParams
from kvtransfer.params import KVTransferParams
from router.client import DecodeClient, InstanceDeadError, PrefillClient
from router.policy import BaseRoutingPolicy
from router.stream import RequestStream, StreamEvent, Tracked

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The router's admission queue is full: try again later (HTTP 429)."""


class Router:
    def __init__(self, prefill: list[PrefillClient], decode: list[DecodeClient], policy: BaseRoutingPolicy,
                 mode: str = "disaggregated", disagg_threshold_tokens: int = 0, max_attempts: int = 3,
                 max_queued: int = 4096, poll_s: float = 0.2):
        self.prefill = {c.info.instance_id: c for c in prefill}
        self.decode = {c.info.instance_id: c for c in decode}
        self.policy, self.mode = policy, mode
        self.disagg_threshold_tokens, self.max_attempts = disagg_threshold_tokens, max_attempts
        self.max_queued, self.poll_s = max_queued, poll_s
        self._lock = threading.RLock()
        self._by_attempt: dict[str, Tracked] = {}
        self._pending: deque[Tracked] = deque()  # waiting for a decode instance to accept
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # cumulative counters (the autoscaler's arrival rate and request shape come from these)
        self.stats = {"retries": 0, "failed": 0, "completed": 0, "submitted": 0, "prompt_tokens": 0,
                      "cached_prompt_tokens": 0, "output_tokens": 0, "instance_deaths": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for iid in [*self.decode, *self.prefill]:
            self._spawn(self._collect, iid)
        self._spawn(self._place_pending)
        self._spawn(self._refresh_loads)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"router-{target.__name__}")
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.poll_s + 1)

    def add_instance(self, client: PrefillClient | DecodeClient) -> None:
        """A new instance joins while serving (placement starts using it at once)."""
        iid, role = client.info.instance_id, client.info.role
        with self._lock:
            (self.prefill if role == "prefill" else self.decode)[iid] = client
        if self._threads:
            self._spawn(self._collect, iid)

    def drain(self, instance_id: str) -> None:
        """No new requests go to the instance; the ones it has run to completion."""
        with self._lock:
            client = self._client(instance_id)
            if client is not None:
                client.info.draining = True

    def _client(self, instance_id: str) -> PrefillClient | DecodeClient | None:
        return self.prefill.get(instance_id) or self.decode.get(instance_id)

    def is_drained(self, instance_id: str) -> bool:
        """True when nothing needs the instance any more: no attempt decodes there, and every
        attempt it prefilled has its KV on the decode side."""
        with self._lock:
            return not any(t.decode_id == instance_id or (t.prefill_id == instance_id and not t.decoding)
                           for t in self._by_attempt.values())

    def remove_instance(self, instance_id: str) -> None:
        """An instance leaves while serving: nothing new goes there; its in-flight requests are
        retried elsewhere (as for a dead one), then it is forgotten."""
        self._mark_dead(instance_id, RuntimeError("removed"))
        with self._lock:
            self.prefill.pop(instance_id, None)
            self.decode.pop(instance_id, None)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               listener=None) -> RequestStream:
        """Starts a request; its tokens arrive on the returned stream (or at `listener`)."""
        tracked = Tracked(request_id, list(prompt_token_ids), params, RequestStream(request_id, listener))
        with self._lock:
            if len(self._pending) >= self.max_queued:
                raise QueueFullError(f"{len(self._pending)} requests already queued")
            self.stats["submitted"] += 1
            self.stats["prompt_tokens"] += len(tracked.prompt_token_ids)
            self._place(tracked)
        return tracked.stream

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request wherever it is (queued, prefilling, decoding)."""
        with self._lock:
            for tracked in [t for t in self._pending if t.request_id == request_id]:
                self._pending.remove(tracked)
                self._finish(tracked, StreamEvent([], True, "abort"))
            for tracked in [t for t in self._by_attempt.values() if t.request_id == request_id]:
                self._abort_attempt(tracked)
                self._finish(tracked, StreamEvent([], True, "abort"))

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._by_attempt) + len(self._pending)

    # -- placement -------------------------------------------------------------------------------------
    def _healthy(self, pool: dict, tracked: Tracked) -> list:
        return [c.info for c in pool.values()
                if c.info.healthy and not c.info.draining and c.info.instance_id not in tracked.excluded]

    def _place(self, tracked: Tracked) -> None:
        """Try to start an attempt now; else queue it (the placement thread retries)."""
        decodes = self._healthy(self.decode, tracked)
        prefills = self._healthy(self.prefill, tracked)
        if not decodes:
            return self._give_up(tracked, "no healthy decode instance")
        prompt = tracked.prompt_token_ids + tracked.delivered
        params = replace(tracked.params, max_tokens=tracked.params.max_tokens - len(tracked.delivered))
        tracked.base, tracked.decoding = len(tracked.delivered), False
        req = Request(tracked.attempt_id, prompt, params)
        local = self.mode == "colocated" or not prefills or len(prompt) < self.disagg_threshold_tokens
        first = self.policy.pick_decode(decodes, prompt)  # once: a policy may keep state (round robin)
        ordered = [first] + [d for d in decodes if d is not first]
        try:
            if local:
                d = self.decode[ordered[0].instance_id]
                d.add_request(req.request_id, prompt, params)
                return self._started(tracked, None, d.info.instance_id)
            p = self.prefill[self.policy.pick_prefill(prefills, prompt).instance_id]
            for info in ordered:
                d = self.decode[info.instance_id]
                if d.reserve(req, p.info.tp_size):
                    self._started(tracked, p.info.instance_id, d.info.instance_id)
                    kv = KVTransferParams(req.request_id, d.info.instance_id, d.info.tp_size, d.info.kv_endpoints)
                    p.submit(Request(req.request_id, prompt, params), kv)
                    return
        except InstanceDeadError as exc:
            tracked.excluded.add(exc.instance_id)
            self._mark_dead(exc.instance_id, exc)  # fails this attempt too if it had started there
            if not tracked.done and tracked.attempt_id not in self._by_attempt:
                self._retry(tracked, str(exc))
            return  # placed again (or queued, or given up) by the retry: never queue it twice
        except ValueError as exc:  # the request itself is bad (e.g. prompt too long)
            return self._give_up(tracked, str(exc))
        self._pending.append(tracked)  # every decode instance is full: admission control

    def _started(self, tracked: Tracked, prefill_id: str | None, decode_id: str) -> None:
        tracked.prefill_id, tracked.decode_id = prefill_id, decode_id
        self._by_attempt[tracked.attempt_id] = tracked

    def _place_pending(self) -> None:
        while not self._stop.wait(0.005):
            with self._lock:
                for _ in range(len(self._pending)):
                    self._place(self._pending.popleft())

    # -- events from instances -------------------------------------------------------------------------
    def _collect(self, iid: str) -> None:
        """One thread per instance: long-polls its events (decode outputs or prefill results)."""
        if iid in self.prefill:
            client, fetch, handle = self.prefill[iid], self.prefill[iid].poll_results, self._on_prefill_result
        else:
            client, fetch, handle = self.decode[iid], self.decode[iid].get_outputs, self._on_decode_output
        while not self._stop.is_set() and client.info.healthy:
            try:
                events = fetch(self.poll_s)
            except InstanceDeadError as exc:
                self._mark_dead(iid, exc)
                return
            with self._lock:
                for event in events:
                    handle(event)

    def _on_prefill_result(self, r) -> None:
        tracked = self._by_attempt.get(r.request_id)
        if tracked is None:
            return
        if r.first_token is None:
            return self._fail(tracked, tracked.prefill_id, r.error or "prefill failed")
        if tracked.attempt == 0:
            self.stats["cached_prompt_tokens"] += r.num_cached_tokens
        if len(tracked.delivered) == tracked.base:  # the decode side may have been faster
            self._deliver(tracked, [r.first_token], None if r.logprobs is None else [r.logprobs])

    def _on_decode_output(self, o) -> None:
        tracked = self._by_attempt.get(o.request_id)
        if tracked is None:
            return
        if o.error:
            return self._fail(tracked, tracked.decode_id, o.error)
        tracked.decoding = True
        have = len(tracked.delivered) - tracked.base  # tokens of this attempt already delivered
        skip = max(0, have - (o.num_output_tokens - len(o.new_token_ids)))
        self._deliver(tracked, o.new_token_ids[skip:], None if o.new_logprobs is None else o.new_logprobs[skip:])
        if o.finished:
            del self._by_attempt[tracked.attempt_id]
            if tracked.prefill_id is not None:
                self._safe(self.prefill[tracked.prefill_id].abort, tracked.attempt_id)
            self.stats["completed"] += 1
            self.stats["output_tokens"] += len(tracked.delivered)
            self._finish(tracked, StreamEvent([], True, o.finish_reason))

    def _deliver(self, tracked: Tracked, token_ids: list[int], logprobs: list[dict] | None = None) -> None:
        if token_ids:
            tracked.delivered += token_ids
            tracked.stream.put(StreamEvent(list(token_ids), logprobs=logprobs))

    def _finish(self, tracked: Tracked, event: StreamEvent) -> None:
        if not tracked.done:
            tracked.done = True
            tracked.stream.put(event)

    # -- failures --------------------------------------------------------------------------------------
    def _fail(self, tracked: Tracked, instance_id: str | None, reason: str) -> None:
        logger.warning("request %s attempt %d failed on %s: %s", tracked.request_id, tracked.attempt,
                       instance_id, reason)
        if instance_id is not None:
            tracked.excluded.add(instance_id)
        self._abort_attempt(tracked)
        self._retry(tracked, reason)

    def _retry(self, tracked: Tracked, reason: str) -> None:
        if tracked.attempt + 1 >= self.max_attempts or tracked.done:
            return self._give_up(tracked, reason)
        tracked.attempt += 1
        self.stats["retries"] += 1
        self._place(tracked)

    def _give_up(self, tracked: Tracked, reason: str) -> None:
        self._by_attempt.pop(tracked.attempt_id, None)
        self.stats["failed"] += 1
        self._finish(tracked, StreamEvent([], True, "error", reason))

    def _abort_attempt(self, tracked: Tracked) -> None:
        self._by_attempt.pop(tracked.attempt_id, None)
        if tracked.prefill_id in self.prefill:
            self._safe(self.prefill[tracked.prefill_id].abort, tracked.attempt_id)
        if tracked.decode_id in self.decode:
            self._safe(self.decode[tracked.decode_id].abort, tracked.attempt_id)

    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except InstanceDeadError:
            pass

    def _mark_dead(self, iid: str, exc: Exception | None = None) -> None:
        """An instance died: every attempt on it is retried elsewhere."""
        with self._lock:
            client = self._client(iid)
            if client is None or not client.info.healthy:
                return
            client.info.healthy = False
            self.stats["instance_deaths"] += 1
            logger.error("instance %s is dead (%s); retrying its requests", iid, exc)
            for tracked in [t for t in self._by_attempt.values() if iid in (t.prefill_id, t.decode_id)]:
                if tracked.prefill_id == iid and tracked.decoding:
                    tracked.prefill_id = None  # its KV is on the decode side already: it goes on there
                    continue
                self._fail(tracked, iid, f"instance {iid} died")

    def _refresh_loads(self) -> None:
        while not self._stop.wait(0.1):
            for client in list(self.prefill.values()) + list(self.decode.values()):
                if client.info.healthy:
                    try:
                        client.info.load = client.load()
                    except InstanceDeadError as exc:
                        self._mark_dead(client.info.instance_id, exc)
