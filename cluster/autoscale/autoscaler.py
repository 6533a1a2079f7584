"""Autoscaling policies: one decision for both pools, from observed load and a performance profile.

    Observation (arrival rate, request shape, queues, KV use) --policy--> PoolSizes --Actuator

`SLOPlanner` sizes the pools to meet latency targets:
  prefill  smallest n whose *queue-inclusive* predicted TTFT stays under the TTFT SLO:
           TTFT(n) = service + M/D/1 wait at utilisation rho = lambda * service / n
                     + time to drain the prefill backlog already queued,
           with utilisation capped at 1 / (1 + headroom)
  decode   the largest batch b* whose step time meets the TBT SLO (profile: itl(b) = base + per_seq * b);
           concurrency C = max(lambda * output_tokens * itl(b*), sequences observed) * (1 + headroom);
           n = max(C / b*, C * tokens per sequence / KV capacity, instances needed at the observed KV use)
Scale-up goes straight to the target (after `scale_up_cooldown_s`); scale-down needs the target
computed with extra headroom (hysteresis) and the *peak* arrival rate of the last
`scale_down_cooldown_s` to be lower for that long, and goes one instance at a time. `QueueThreshold` is the simple reactive baseline: +/-1 on queue depth and KV use.
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.forecast import Forecaster
from cluster.spec import ClusterSpec

HYSTERESIS = 0.25  # extra headroom a lower target must show before a pool shrinks
KV_HIGH = 0.85  # KV use above which a decode pool is short of memory


@dataclass(frozen=True)
class Profile:
    """What one instance can do: measured offline (`pdserve bench --profile`) or online."""

    prefill_tokens_per_s: float  # one prefill instance, saturated
    decode_itl_base_s: float  # decode step time = base + per_seq * batch
    decode_itl_per_seq_s: float
    max_num_seqs: int  # the engine's batch limit
    kv_capacity_tokens: int  # KV cache of one decode instance, tokens
    startup_s: float = 30.0  # cold start: from asking for an instance to it serving (assumed until measured)
    flip_s: float = 1.0  # a drained instance's role change (cluster/control/flip.py; assumed until measured)

    def itl(self, batch: float) -> float:
        return self.decode_itl_base_s + self.decode_itl_per_seq_s * batch

    def max_batch(self, tbt_slo_s: float) -> int:
        """The largest batch whose step time meets `tbt_slo_s` (at least 1)."""
        if self.decode_itl_per_seq_s <= 0:
            return self.max_num_seqs
        fit = math.floor((tbt_slo_s - self.decode_itl_base_s) / self.decode_itl_per_seq_s)
        return max(1, min(self.max_num_seqs, fit))

    def save(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **extra}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = set(cls.__dataclass_fields__) - set(known) - {"startup_s", "flip_s"}
        if missing:
            raise ValueError(f"{path}: profile lacks {', '.join(sorted(missing))}")
        return cls(**known)


@dataclass(frozen=True)
class Observation:
    """The cluster over the last interval (rates and means over a window, levels now)."""

    now: float
    sizes: PoolSizes
    arrival_rate: float  # requests/s
    mean_prompt_tokens: float
    mean_uncached_tokens: float  # prompt tokens a prefill computes (prefix-cache hits excluded)
    mean_output_tokens: float
    queued_prefill_tokens: float = 0.0  # all prefill instances
    decode_running: float = 0.0  # sequences on all decode instances
    decode_waiting: float = 0.0
    decode_kv_usage: float = 0.0  # mean over decode instances, 0..1


@dataclass(frozen=True)
class ScalingLimits:
    """Pool bounds, headroom and cool-downs; the defaults are the cluster spec's."""

    min_prefill: int = ClusterSpec.min_prefill
    max_prefill: int = ClusterSpec.max_prefill
    min_decode: int = ClusterSpec.min_decode
    max_decode: int = ClusterSpec.max_decode
    headroom: float = ClusterSpec.scale_headroom
    scale_up_cooldown_s: float = ClusterSpec.scale_up_cooldown_s
    scale_down_cooldown_s: float = ClusterSpec.scale_down_cooldown_s
    max_instances: int = ClusterSpec.max_instances  # both pools together (a fixed fleet); 0: no bound

    @classmethod
    def from_spec(cls, spec) -> ScalingLimits:
        return cls(spec.min_prefill, spec.max_prefill, spec.min_decode, spec.max_decode, spec.scale_headroom,
                   spec.scale_up_cooldown_s, spec.scale_down_cooldown_s, spec.max_instances)

    def clamp(self, pool: str, n: int) -> int:
        lo, hi = (self.min_prefill, self.max_prefill) if pool == "prefill" else (self.min_decode, self.max_decode)
        return max(lo, min(hi, n))


@dataclass
class _PoolState:
    last_change_s: float = -math.inf
    lower_since_s: float | None = None  # when a lower target was first seen (hysteresis)


class Policy(ABC):
    """Turns observations into pool sizes, with cool-downs, hysteresis, flips and bounds.

    A pool shrinks by one when its scale-down target is below its size, nothing changed for
    `scale_down_cooldown_s` and (`persist_lower`) the lower target has held that long too.
    A pool that must grow takes the other pool's spare instances (above that pool's scale-down
    target) by flipping them when `flip_time` says a flip serves sooner than a cold start, or when
    `max_instances` leaves no room to add; what is left it adds (within `max_instances`).
    """

    persist_lower = True

    def __init__(self, limits: ScalingLimits):
        self.limits = limits
        self._pools = {"prefill": _PoolState(), "decode": _PoolState()}
        self.last_targets: dict[str, int] = {}
        self.moves = {"flip": 0, "add": 0, "remove": 0}  # instances, over all decisions

    @abstractmethod
    def targets(self, obs: Observation) -> dict[str, tuple[int, int]]:
        """Per pool (scale-up target, scale-down target); the second is the stricter one."""

    def flip_time(self, src: str, obs: Observation) -> float | None:
        """Seconds until an instance of `src` serves as the other role (its drain and its flip);
        None: this policy does not flip."""
        return None

    def decide(self, obs: Observation) -> PoolSizes:
        targets = {pool: (self.limits.clamp(pool, up), self.limits.clamp(pool, down))
                   for pool, (up, down) in self.targets(obs).items()}
        cur = {pool: getattr(obs.sizes, pool) for pool in targets}
        out = {pool: self._resize(pool, cur[pool], up, down, obs.now) for pool, (up, down) in targets.items()}
        flipped = self._flips(obs, targets, cur, out)
        self._cap(cur, out)
        for pool, st in self._pools.items():
            self.last_targets[pool] = targets[pool][0]
            if out[pool] != cur[pool]:
                st.last_change_s, st.lower_since_s = obs.now, None
        grown = sum(max(0, out[p] - cur[p]) for p in out)
        self.moves["flip"] += flipped
        self.moves["add"] += grown - flipped
        self.moves["remove"] += sum(max(0, cur[p] - out[p]) for p in out) - flipped
        return PoolSizes(**out)

    def _resize(self, pool: str, cur: int, up: int, down: int, now: float) -> int:
        """The pool on its own: up after the cool-down, down by one after the quiet time."""
        st = self._pools[pool]
        if up > cur:
            st.lower_since_s = None
            return up if now - st.last_change_s >= self.limits.scale_up_cooldown_s else cur
        if down < cur:
            st.lower_since_s = now if st.lower_since_s is None else st.lower_since_s
            quiet = now - st.last_change_s
            if self.persist_lower:
                quiet = min(quiet, now - st.lower_since_s)
            # (never quicker than a cold start: what leaves could not come back sooner)
            return cur - 1 if quiet >= max(self.limits.scale_down_cooldown_s, self.startup_s()) else cur
        st.lower_since_s = None
        return cur

    def _flips(self, obs: Observation, targets: dict, cur: dict, out: dict) -> int:
        """Moves spare instances to the pool that must grow, where a flip beats a cold start; how many."""
        for src, dst in (("prefill", "decode"), ("decode", "prefill")):
            short = targets[dst][0] - cur[dst]
            spare = cur[src] - max(targets[src])
            cooled = obs.now - self._pools[dst].last_change_s >= self.limits.scale_up_cooldown_s
            full = self.limits.max_instances and sum(cur.values()) + short > self.limits.max_instances
            if full and short > 0 and spare <= 0 and cur[src] > self.limits.clamp(src, 0) \
                    and not self.meets_slo(dst, cur[dst], obs) and self.meets_slo(src, cur[src] - 1, obs):
                spare = 1  # a full fleet: the pool missing its SLO now takes one the other can spare now
            n = min(short, spare)
            took = self.flip_time(src, obs)
            if n <= 0 or not cooled or took is None:
                continue
            if took >= self.startup_s() and not full:
                continue  # a cold start serves as soon: add, and let the spare go after its quiet time
            out[src], out[dst] = min(out[src], cur[src] - n), max(out[dst], cur[dst] + n)
            return n
        return 0

    def startup_s(self) -> float:
        """Seconds from asking for a new instance to it serving (0: unknown)."""
        return 0.0

    def meets_slo(self, pool: str, n: int, obs: Observation) -> bool:
        """Whether `n` instances of `pool` serve the load now within the SLO (no headroom, no forecast)."""
        return True

    def _cap(self, cur: dict, out: dict) -> None:
        """Growth trimmed to `max_instances` in all (the pool grown most first); shrinking is never held."""
        cap = self.limits.max_instances
        while cap and sum(out.values()) > max(cap, sum(cur.values())):
            pool = max(out, key=lambda p: out[p] - cur[p])
            out[pool] -= 1


class SLOPlanner(Policy):
    def __init__(self, profile: Profile, limits: ScalingLimits, ttft_slo_s: float, tbt_slo_s: float,
                 rate_window_s: float = 30.0, forecaster: Forecaster | None = None, flips: bool = True):
        """`rate_window_s`: the arrival rate is the mean over this window (one interval's count is noisy).
        `forecaster`: the rate one cold start ahead (cluster/autoscale/forecast.py); None: no forecast.
        `flips`: whether a pool may grow by flipping the other's spare instances (else add and remove)."""
        super().__init__(limits)
        self.profile, self.ttft_slo_s, self.tbt_slo_s = profile, ttft_slo_s, tbt_slo_s
        self.rate_window_s, self.forecaster, self.flips = rate_window_s, forecaster, flips
        # (now, arrival rate, its mean over rate_window_s) for the longer of the two windows
        self._history: deque[tuple[float, float, float]] = deque()
        self.standby = {"prefill": 0, "decode": 0}  # instances the forecast asks for beyond the rate now

    def startup_s(self) -> float:
        return self.profile.startup_s

    def meets_slo(self, pool: str, n: int, obs: Observation) -> bool:
        """Prefill: the predicted TTFT (its queue included). Decode: the step time at the batch that is
        there (running and waiting), and the KV in use fits."""
        if pool == "prefill":
            return self.predicted_ttft(n, obs) <= self.ttft_slo_s
        if n < 1:
            return False
        batch = (obs.decode_running + obs.decode_waiting) / n
        return self.profile.itl(batch) <= self.tbt_slo_s and obs.decode_kv_usage * obs.sizes.decode / n <= 1

    def flip_time(self, src: str, obs: Observation) -> float | None:
        """The least loaded instance's drain (a decode one: its sequences' remaining tokens; a prefill
        one: its queue) and the measured flip."""
        p = self.profile
        if not self.flips:
            return None
        if src == "decode":
            per_instance = obs.decode_running / max(obs.sizes.decode, 1)
            drain = obs.mean_output_tokens * p.itl(per_instance)
        else:
            drain = obs.queued_prefill_tokens / max(obs.sizes.prefill, 1) / p.prefill_tokens_per_s
        return drain + p.flip_s

    def predicted_ttft(self, n: int, obs: Observation) -> float:
        """Queue-inclusive TTFT with `n` prefill instances (inf when they cannot keep up)."""
        if n < 1:
            return math.inf
        rate = self.profile.prefill_tokens_per_s
        service = obs.mean_uncached_tokens / rate
        rho = obs.arrival_rate * service / n
        if rho >= 1:
            return math.inf
        wait = rho * service / (2 * (1 - rho))  # M/D/1 queueing delay
        backlog = obs.queued_prefill_tokens / (n * rate)
        return service + wait + backlog

    def _prefill_needed(self, obs: Observation, headroom: float) -> int:
        service = obs.mean_uncached_tokens / self.profile.prefill_tokens_per_s
        for n in range(self.limits.min_prefill, self.limits.max_prefill + 1):
            util_ok = obs.arrival_rate * service / n <= 1 / (1 + headroom)
            if util_ok and self.predicted_ttft(n, obs) * (1 + headroom) <= self.ttft_slo_s:
                return n
        return self.limits.max_prefill

    def _decode_needed(self, obs: Observation, headroom: float) -> int:
        p = self.profile
        b_star = p.max_batch(self.tbt_slo_s)
        concurrency = max(obs.arrival_rate * obs.mean_output_tokens * p.itl(b_star),
                          obs.decode_running + obs.decode_waiting) * (1 + headroom)
        per_seq_tokens = obs.mean_prompt_tokens + obs.mean_output_tokens
        by_batch = math.ceil(concurrency / b_star)
        by_kv = math.ceil(concurrency * per_seq_tokens / (p.kv_capacity_tokens * KV_HIGH))
        by_use = math.ceil(obs.sizes.decode * obs.decode_kv_usage * (1 + headroom) / KV_HIGH)
        return max(1, by_batch, by_kv, by_use)

    def targets(self, obs: Observation) -> dict[str, tuple[int, int]]:
        """Up: the mean arrival rate of the last `rate_window_s`. Down: the peak of that mean over
        the scale-down window, with more headroom (a quiet spell in a busy period does not shrink
        a pool only to grow it back)."""
        span = max(self.limits.scale_down_cooldown_s, self.rate_window_s)
        while self._history and obs.now - self._history[0][0] > span:
            self._history.popleft()
        recent = [rate for t, rate, _ in self._history if obs.now - t < self.rate_window_s] + [obs.arrival_rate]
        now = replace(obs, arrival_rate=sum(recent) / len(recent))
        self._history.append((obs.now, obs.arrival_rate, now.arrival_rate))
        peak = replace(obs, arrival_rate=max(mean for *_, mean in self._history))
        h = self.limits.headroom
        out = {"prefill": (self._prefill_needed(now, h), self._prefill_needed(peak, h + HYSTERESIS)),
               "decode": (self._decode_needed(now, h), self._decode_needed(peak, h + HYSTERESIS))}
        if self.forecaster is None:
            return out
        self.forecaster.observe(obs.now, obs.arrival_rate)
        ahead = replace(obs, arrival_rate=self.forecaster.predict(self.profile.startup_s))
        if ahead.arrival_rate <= now.arrival_rate:
            self.standby = {"prefill": 0, "decode": 0}
            return out
        up = {"prefill": self._prefill_needed(ahead, h), "decode": self._decode_needed(ahead, h)}
        self.standby = {pool: max(0, up[pool] - out[pool][0]) for pool in out}
        return {pool: (max(up[pool], out[pool][0]), max(up[pool], out[pool][1])) for pool in out}


class QueueThreshold(Policy):
    """+1 when a pool's queue (or KV use) is over its high mark, -1 when under its low mark."""

    def __init__(self, limits: ScalingLimits, prefill_queue_high: float = 4096.0, prefill_queue_low: float = 256.0,
                 kv_high: float = 0.8, kv_low: float = 0.3):
        """Queue marks are prompt tokens queued per prefill instance; KV marks are mean use, 0..1."""
        super().__init__(limits)
        self.prefill_queue_high, self.prefill_queue_low = prefill_queue_high, prefill_queue_low
        self.kv_high, self.kv_low = kv_high, kv_low

    def targets(self, obs: Observation) -> dict[str, tuple[int, int]]:
        p, d = obs.sizes.prefill, obs.sizes.decode
        queue = obs.queued_prefill_tokens / max(p, 1)
        p_up = p + 1 if queue > self.prefill_queue_high else p
        p_down = p - 1 if queue < self.prefill_queue_low else p
        busy = obs.decode_kv_usage > self.kv_high or obs.decode_waiting > 0
        d_up = d + 1 if busy else d
        d_down = d - 1 if obs.decode_kv_usage < self.kv_low and not busy else d
        return {"prefill": (p_up, p_down), "decode": (d_up, d_down)}
