"""A key's limits (gateway/api_keys.py): its request rate (a token bucket), its requests in flight, and
its tokens in flight (a token budget: each request holds prompt + n x max_tokens until it ends).

Held cluster-wide in Redis where the gateway has one (the cluster state's, `redis_url`): every
gateway runs the same atomic scripts (gateway/limit_scripts.py) against one set of keys per API key,
so N gateways admit a key's rate once, not N times. A request's hold there is a lease that its
gateway renews while the request runs (`LEASE_S`; a gateway that dies frees its holds when they
lapse). Without Redis, or while it does not answer (`FALLBACK_RETRY_S` between tries), each gateway
holds the limits for itself (`LocalLimits`: a key's rate per gateway, as before), said in one log
line when it happens and when Redis answers again, and in `pdserve_api_key_limits_shared` (0) and
`pdserve_api_key_limits_local_decisions_total`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from engine.core.request import SamplingParams
from gateway.api_keys import APIKey
from gateway.protocol import APIError

logger = logging.getLogger(__name__)
FALLBACK_RETRY_S = 5.0  # after Redis failed to answer, how long limits stay local before it is tried again
LEASE_S = 60.0  # a hold in Redis lapses this long after its gateway last renewed it (every LEASE_S / 3)
REDIS_TIMEOUT_S = 0.5  # a limit decision waits no longer for Redis (then: local)


class KeyLimitError(APIError):
    """A 429 of a key's own limits; `outcome` ("rate_limited", "concurrency_limited", "token_limited")
    labels the metrics. `retry_after_s` None: retrying cannot help (a request over the whole budget)."""

    def __init__(self, outcome: str, message: str, retry_after_s: int | None, code: str = "rate_limit_exceeded"):
        super().__init__(429, message, "requests", code=code,  # OpenAI's body for its own limits
                         headers={} if retry_after_s is None else {"Retry-After": str(retry_after_s)})
        self.outcome = outcome


def tenant_class(key: APIKey, asked: int | None, params: SamplingParams) -> SamplingParams:
    """`params` in its key's class: the key's `priority` where the request named none; APIError(400)
    for a request that asks for a more urgent class than its key may (a lower value)."""
    if asked is None:
        return replace(params, priority=key.priority)
    if asked < key.priority:
        raise APIError(400, f"priority {asked} is more urgent than API key {key.name!r} may ask for (its class is "
                            f"{key.priority}; a lower value is more urgent)", param="priority")
    return params


def concurrency_error(key: APIKey) -> KeyLimitError:
    return KeyLimitError("concurrency_limited", f"concurrency limit reached for API key {key.name!r}: "
                         f"{key.max_concurrent} requests in flight; retry when one of them ends", 1)


def rate_error(key: APIKey, wait_s: float) -> KeyLimitError:
    retry = max(1, math.ceil(wait_s))
    return KeyLimitError("rate_limited", f"rate limit reached for API key {key.name!r}: {key.requests_per_second:g} "
                         f"requests per second (burst {key.bucket_size}); try again in {retry}s", retry)


def token_error(key: APIKey, tokens: int, held: int) -> KeyLimitError:
    """429 naming the budget: a request over the whole of it can never run (no Retry-After)."""
    if tokens > key.token_budget:
        return KeyLimitError("token_limited", f"this request needs {tokens} tokens (prompt + n x max_tokens), more "
                             f"than the token budget of API key {key.name!r} ({key.token_budget}): lower max_tokens "
                             "or n", None, code="token_budget_exceeded")
    return KeyLimitError("token_limited", f"token budget reached for API key {key.name!r}: its requests in flight "
                         f"hold {held} of {key.token_budget} tokens and this one needs {tokens}; retry when one "
                         "ends", 1)


@dataclass
class Hold:
    """One admitted request's hold on its key's limits, until `release`."""
    key: APIKey
    id: str
    shared: bool = False  # held in Redis (else in this process)
    tokens: int = 0  # its token budget charge


class TokenBucket:
    """`rate` tokens a second, up to `size` of them; a request takes one. Starts full."""

    def __init__(self, rate: float, size: int, now: float):
        self.rate, self.size = rate, size
        self.tokens, self.updated = float(size), now

    def take(self, now: float) -> float:
        """Takes a token: 0.0; or, with none there, the seconds until one is (nothing taken)."""
        self.tokens = min(self.size, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class LocalLimits:
    """The limits held in this process. Used on the event loop, and `replace` from the keys file's
    watcher thread: counters change under a lock held for a few dict operations."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self._lock = clock, threading.Lock()
        self.keys: dict[str, APIKey] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.in_flight: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def replace(self, keys: Iterable[APIKey]) -> None:
        """A key that keeps its name and rate keeps its bucket (a reload refills no one); requests
        in flight stay counted under their key's name until they end."""
        with self._lock:
            old = self.keys
            self.buckets = {k.name: self.buckets[k.name] if _same_bucket(old.get(k.name), k)
                            else TokenBucket(k.requests_per_second, k.bucket_size, self.clock())
                            for k in keys if k.requests_per_second is not None}
            self.in_flight = {**{k.name: 0 for k in keys}, **{n: c for n, c in self.in_flight.items() if c > 0}}
            self.tokens = {n: c for n, c in self.tokens.items() if c > 0}
            self.keys = {k.name: k for k in keys}

    def admit(self, hold: Hold) -> None:
        key = hold.key
        with self._lock:
            if key.max_concurrent is not None and self.in_flight.get(key.name, 0) >= key.max_concurrent:
                raise concurrency_error(key)
            bucket = self.buckets.get(key.name)
            wait_s = 0.0 if bucket is None else bucket.take(self.clock())
            if wait_s > 0:
                raise rate_error(key, wait_s)
            self.in_flight[key.name] = self.in_flight.get(key.name, 0) + 1

    def charge(self, hold: Hold, tokens: int) -> None:
        key = hold.key
        with self._lock:
            held = self.tokens.get(key.name, 0)
            if tokens > key.token_budget or held + tokens > key.token_budget:
                raise token_error(key, tokens, held)
            self.tokens[key.name] = held + tokens
            hold.tokens = tokens

    def release(self, hold: Hold) -> None:
        with self._lock:
            name = hold.key.name
            assert self.in_flight.get(name, 0) > 0, name
            self.in_flight[name] -= 1
            self.tokens[name] = self.tokens.get(name, 0) - hold.tokens


def _same_bucket(old: APIKey | None, new: APIKey) -> bool:
    return old is not None and (old.requests_per_second, old.bucket_size) == (new.requests_per_second, new.bucket_size)


class KeyLimits:
    """A key's limits, in Redis (`shared`: gateway/limit_scripts.py SharedLimits) or, without it or
    while it does not answer, in this process (see the module). `on_mode(shared: bool)` is told
    every decision's mode: (held in Redis, Redis configured), for the metrics."""

    def __init__(self, shared=None, clock: Callable[[], float] = time.monotonic,
                 on_mode: Callable[[bool, bool], None] = lambda shared, configured: None):
        self.local, self.shared, self.clock, self.on_mode = LocalLimits(clock), shared, clock, on_mode
        self._down_until = -math.inf  # Redis failed: local until then
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._holds: dict[str, Hold] = {}  # shared holds of requests in flight (their leases are renewed)
        self._releasing: set[asyncio.Task] = set()
        self._renewals: asyncio.Task | None = None  # started with the first shared hold, on its event loop

    def _use_shared(self) -> bool:
        return self.shared is not None and self.clock() >= self._down_until

    def _failed(self, exc: BaseException) -> None:
        if self._down_until == -math.inf:
            logger.warning("API key limits: Redis did not answer (%s: %s); each gateway holds them for itself "
                           "until it does (tried again every %g s)", type(exc).__name__, exc, FALLBACK_RETRY_S)
        self._down_until = self.clock() + FALLBACK_RETRY_S

    def _answered(self) -> None:
        if self._down_until != -math.inf:
            logger.warning("API key limits: Redis answers again; they are held cluster-wide")
            self._down_until = -math.inf

    async def admit(self, key: APIKey) -> Hold:
        """Counts a new request of `key` in flight; `release` its hold when its response ends.
        Raises KeyLimitError (429): its concurrency limit is reached or its bucket is empty."""
        hold = Hold(key, f"{self._prefix}-{next(self._ids)}")
        if self._use_shared() and key.limited:
            try:
                await asyncio.wait_for(self.shared.admit(hold, LEASE_S), REDIS_TIMEOUT_S)
                hold.shared = True
                self._holds[hold.id] = hold
                if self._renewals is None or self._renewals.done():
                    self._renewals = asyncio.get_running_loop().create_task(self.run_renewals())
                self._answered()
                self.on_mode(True, True)
                return hold
            except KeyLimitError:
                self.on_mode(True, True)
                raise
            except Exception as exc:  # unreachable, timed out, an error reply: decided here
                self._failed(exc)
        self.local.admit(hold)
        if key.limited:
            self.on_mode(False, self.shared is not None)
        return hold

    async def charge(self, hold: Hold, tokens: int) -> None:
        """Charges the request's tokens (prompt + n x max_tokens) to its key's budget, where the
        key has one. Raises KeyLimitError (429) naming the budget."""
        if hold.key.token_budget is None:
            return
        if hold.shared:
            try:
                await asyncio.wait_for(self.shared.charge(hold, tokens, LEASE_S), REDIS_TIMEOUT_S)
                hold.tokens = tokens
                return
            except KeyLimitError:
                raise
            except Exception as exc:
                self._failed(exc)  # its hold stays Redis' (released there); its tokens go uncounted
                if tokens > hold.key.token_budget:
                    raise token_error(hold.key, tokens, 0) from None
                return
        self.local.charge(hold, tokens)

    async def release(self, hold: Hold) -> None:
        """Ends the hold. In Redis, on a task of its own: a stream's end may be a cancellation, which
        must not cut the release short (what fails to reach Redis lapses with its lease)."""
        if not hold.shared:
            self.local.release(hold)
            return
        self._holds.pop(hold.id, None)
        task = asyncio.get_running_loop().create_task(self._release_shared(hold))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_shared(self, hold: Hold) -> None:
        try:
            await asyncio.wait_for(self.shared.release(hold), REDIS_TIMEOUT_S)
        except Exception as exc:  # its lease lapses in Redis instead
            self._failed(exc)

    async def renew(self) -> None:
        """Renews the leases of this gateway's shared holds (every LEASE_S / 3: `run_renewals`)."""
        holds = list(self._holds.values())
        if holds and self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.renew(holds, LEASE_S), 5 * REDIS_TIMEOUT_S)
            except Exception as exc:
                self._failed(exc)

    async def run_renewals(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            await self.renew()
