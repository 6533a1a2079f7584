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
    startup_s: float = 30.0  # from asking for an instance to it serving (used by the simulator)

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
        missing = set(cls.__dataclass_fields__) - set(known) - {"startup_s"}
        if missing:
            raise ValueError(f"{path}: profile lacks {', '.join(sorted(missing))}")
        return cls(**known)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; slope 0 through the mean for one distinct x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    slope = max(slope, 0.0)  # a step never gets cheaper with more sequences
    return my - slope * mx, slope


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

    @classmethod
    def from_spec(cls, spec) -> ScalingLimits:
        return cls(spec.min_prefill, spec.max_prefill, spec.min_decode, spec.max_decode, spec.scale_headroom,
                   spec.scale_up_cooldown_s, spec.scale_down_cooldown_s)

    def clamp(self, pool: str, n: int) -> int:
        lo, hi = (self.min_prefill, self.max_prefill) if pool == "prefill" else (self.min_decode, self.max_decode)
        return max(lo, min(hi, n))


@dataclass
class _PoolState:
    last_change_s: float = -math.inf
    lower_since_s: float | None = None  # when a lower target was first seen (hysteresis)


class Policy(ABC):
    """Turns observations into pool sizes, with cool-downs, hysteresis and bounds.

    A pool shrinks by one when its scale-down target is below its size, nothing changed for
    `scale_down_cooldown_s` and (`persist_lower`) the lower target has held that long too.
    """

    persist_lower = True

    def __init__(self, limits: ScalingLimits):
        self.limits = limits
        self._pools = {"prefill": _PoolState(), "decode": _PoolState()}
        self.last_targets: dict[str, int] = {}

    @abstractmethod
    def targets(self, obs: Observation) -> dict[str, tuple[int, int]]:
        """Per pool (scale-up target, scale-down target); the second is the stricter one."""

    def decide(self, obs: Observation) -> PoolSizes:
        out = {}
        for pool, (up, down) in self.targets(obs).items():
            cur, st = getattr(obs.sizes, pool), self._pools[pool]
            up, down = self.limits.clamp(pool, up), self.limits.clamp(pool, down)
            self.last_targets[pool] = up
            new = cur
            if up > cur:
                st.lower_since_s = None
                if obs.now - st.last_change_s >= self.limits.scale_up_cooldown_s:
                    new = up
            elif down < cur:
                st.lower_since_s = obs.now if st.lower_since_s is None else st.lower_since_s
                quiet = obs.now - st.last_change_s
                if self.persist_lower:
                    quiet = min(quiet, obs.now - st.lower_since_s)
                if quiet >= self.limits.scale_down_cooldown_s:
                    new = cur - 1
            else:
                st.lower_since_s = None
            if new != cur:
                st.last_change_s, st.lower_since_s = obs.now, None
            out[pool] = new
        return PoolSizes(**out)


class SLOPlanner(Policy):
    def __init__(self, profile: Profile, limits: ScalingLimits, ttft_slo_s: float, tbt_slo_s: float,
                 rate_window_s: float = 30.0):
        """`rate_window_s`: the arrival rate is the mean over this window (one interval's count is noisy)."""
        super().__init__(limits)
        self.profile, self.ttft_slo_s, self.tbt_slo_s = profile, ttft_slo_s, tbt_slo_s
        self.rate_window_s = rate_window_s
        # (now, arrival rate, its mean over rate_window_s) for the longer of the two windows
        self._history: deque[tuple[float, float, float]] = deque()

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
        return {"prefill": (self._prefill_needed(now, h), self._prefill_needed(peak, h + HYSTERESIS)),
                "decode": (self._decode_needed(now, h), self._decode_needed(peak, h + HYSTERESIS))}


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
