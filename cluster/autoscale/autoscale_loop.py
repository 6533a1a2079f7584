"""The autoscaler at run time: observe the cluster, let the policy decide, actuate, export metrics.

Every `interval_s`:  every router's counters + instance loads -> Observation (LoadWindow)
                     instance counters -> Profile (OnlineProfile, unless a profile file was given)
                     policy.decide -> actuator.apply          (a thread of its own; a drain may block it)
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.autoscale.actuators import Actuator, PoolSizes
from cluster.autoscale.autoscaler import Observation, Policy, Profile, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import fit_line
from cluster.autoscale.factory import create_actuator, create_policy

logger = logging.getLogger(__name__)


class LoadWindow:
    """Turns the routers' cumulative counters (every gateway's, from the cluster state) into rates
    and means over the last interval; keeps the last known request shape while no request arrives.
    A router seen for the first time counts from zero; one that went away stops counting."""

    COUNTERS = ("submitted", "prompt_tokens", "cached_prompt_tokens", "completed", "output_tokens")

    def __init__(self, cluster):
        self.cluster = cluster
        self._last_t, self._last = time.monotonic(), cluster.router_stats()
        self.shape = {"prompt": 0.0, "uncached": 0.0, "output": 0.0}

    def observe(self, sizes: PoolSizes) -> Observation:
        now, routers = time.monotonic(), self.cluster.router_stats()
        d = {k: sum(st.get(k, 0.0) - self._last.get(rid, {}).get(k, 0.0) for rid, st in routers.items())
             for k in self.COUNTERS}
        dt, self._last_t, self._last = max(now - self._last_t, 1e-6), now, routers
        pending = sum(st.get("pending", 0.0) for st in routers.values())
        if d["submitted"]:
            self.shape["prompt"] = d["prompt_tokens"] / d["submitted"]
            self.shape["uncached"] = max(1.0, (d["prompt_tokens"] - d["cached_prompt_tokens"]) / d["submitted"])
        if d["completed"]:
            self.shape["output"] = d["output_tokens"] / d["completed"]
        infos = [i for i in self.cluster.instance_infos() if i.healthy]
        decode = [i.load for i in infos if i.role in ("decode", "colocated")]
        return Observation(
            now=now, sizes=sizes, arrival_rate=d["submitted"] / dt, mean_prompt_tokens=self.shape["prompt"],
            mean_uncached_tokens=self.shape["uncached"], mean_output_tokens=self.shape["output"],
            queued_prefill_tokens=sum(i.load.queued_prefill_tokens for i in infos if i.role == "prefill"),
            decode_running=sum(load.running for load in decode),
            decode_waiting=sum(load.waiting for load in decode) + pending,
            decode_kv_usage=sum(load.kv_usage for load in decode) / max(len(decode), 1))


class OnlineProfile:
    """A Profile measured from the instances' own counters: prefill tokens per busy second, and
    a line through (mean batch, seconds per step) points of recent decode intervals."""

    MIN_BUSY_S, MIN_STEPS = 1.0, 5

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = 0
        self.prefill_tokens_per_s: float | None = None
        self.points: deque[tuple[float, float]] = deque(maxlen=64)
        self._last: dict[str, dict[str, float]] = {}
        self._tokens = self._busy = 0.0  # prefill work not yet folded in (sparse load spans intervals)

    def update(self, cluster) -> Profile | None:
        """Folds in the counters since the last call; None until both pools have been measured."""
        for info in cluster.instance_infos():
            load, last = info.load.figures, self._last.get(info.instance_id, {})
            delta = {k: load.get(k, 0.0) - last.get(k, 0.0) for k in load}
            self._last[info.instance_id] = dict(load)
            self.kv_capacity_tokens = max(self.kv_capacity_tokens, int(load.get("kv_capacity_tokens", 0)))
            self._tokens += delta.get("prefill_tokens_computed", 0.0)
            self._busy += delta.get("prefill_busy_s", 0.0)
            if delta.get("decode_steps", 0.0) >= self.MIN_STEPS:
                steps = delta["decode_steps"]
                self.points.append((delta["decode_step_seqs"] / steps, delta["decode_step_s"] / steps))
        if self._busy >= self.MIN_BUSY_S:
            tps, self._tokens, self._busy = self._tokens / self._busy, 0.0, 0.0
            self.prefill_tokens_per_s = tps if self.prefill_tokens_per_s is None else \
                0.5 * self.prefill_tokens_per_s + 0.5 * tps
        if self.prefill_tokens_per_s is None or not self.points or not self.kv_capacity_tokens:
            return None
        base, per_seq = fit_line(list(self.points))
        return Profile(self.prefill_tokens_per_s, base, per_seq, self.max_num_seqs, self.kv_capacity_tokens)


class Autoscaler:
    def __init__(self, cluster, policy: Policy, actuator: Actuator, interval_s: float,
                 profile: Profile | None = None, online: OnlineProfile | None = None):
        self.cluster, self.policy, self.actuator, self.interval_s = cluster, policy, actuator, interval_s
        self.profile, self.online = profile, online
        self.window = LoadWindow(cluster)
        self.last: Observation | None = None
        self.desired: PoolSizes | None = None
        self.decisions = {(role, d): 0 for role in ("prefill", "decode") for d in ("up", "down")}
        self.errors = 0
        self._said_profiling = False
        self._measured: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> PoolSizes | None:
        """One decision; None while the online profile has no measurements yet."""
        current = self.actuator.current()
        obs = self.window.observe(current)
        if self.online is not None:
            self.profile = self.online.update(self.cluster) or self.profile
        measured = self.actuator.measured()
        if measured != self._measured:
            logger.info("autoscaler: measured %s", ", ".join(f"{k} {v:.2f}" for k, v in measured.items()))
            self._measured = measured
        if self.profile is not None:
            self.profile = replace(self.profile, **measured)
        self.last = obs
        if isinstance(self.policy, SLOPlanner):
            if self.profile is None:
                if not self._said_profiling:
                    logger.info("autoscaler: profiling (no decision until both pools have been measured)")
                    self._said_profiling = True
                return None
            self.policy.profile = self.profile
        target = self.policy.decide(obs)
        self.desired = target
        for role in ("prefill", "decode"):
            change = getattr(target, role) - getattr(current, role)
            if change:
                self.decisions[(role, "up" if change > 0 else "down")] += 1
        if target != current:
            logger.info("autoscaler: %s -> %s (arrival %.2f req/s, prefill queue %.0f tokens, decode running %.0f)",
                        current, target, obs.arrival_rate, obs.queued_prefill_tokens, obs.decode_running)
            self.actuator.apply(target)
        return target

    def start(self) -> Autoscaler:
        self._thread = threading.Thread(target=self._run, daemon=True, name="autoscaler")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # an actuator failure must not stop serving; it is logged and counted
                self.errors += 1
                logger.exception("autoscaler step failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)

    def collect(self):
        """Prometheus families (registered by the gateway's metrics)."""
        desired = GaugeMetricFamily("pdserve_autoscaler_desired_instances", "instances the autoscaler wants",
                                    labels=["role"])
        current = GaugeMetricFamily("pdserve_autoscaler_current_instances", "instances serving", labels=["role"])
        sizes = self.actuator.current()
        for role in ("prefill", "decode"):
            current.add_metric([role], getattr(sizes, role))
            if self.desired is not None:
                desired.add_metric([role], getattr(self.desired, role))
        decisions = CounterMetricFamily("pdserve_autoscaler_decisions", "pool size changes decided",
                                        labels=["role", "direction"])
        for (role, direction), n in self.decisions.items():
            decisions.add_metric([role, direction], n)
        rate = GaugeMetricFamily("pdserve_autoscaler_arrival_rate", "requests/s over the last interval")
        rate.add_metric([], self.last.arrival_rate if self.last else 0.0)
        moves = CounterMetricFamily("pdserve_autoscaler_moves", "instances flipped to the other role, added, "
                                    "removed", labels=["move"])
        for move, n in self.policy.moves.items():
            moves.add_metric([move], n)
        families = [desired, current, decisions, rate, moves]
        if isinstance(self.policy, SLOPlanner) and self.profile is not None and self.last is not None:
            families.extend(self._planner_families())
        errors = CounterMetricFamily("pdserve_autoscaler_errors", "autoscaler steps that failed")
        errors.add_metric([], self.errors)
        yield from [*families, errors]

    def _planner_families(self):
        ttft = GaugeMetricFamily("pdserve_autoscaler_predicted_ttft_seconds",
                                 "queue-inclusive TTFT predicted at the current prefill pool size")
        ttft.add_metric([], min(self.policy.predicted_ttft(self.last.sizes.prefill, self.last), 1e9))
        standby = GaugeMetricFamily("pdserve_autoscaler_standby_instances", "instances asked for ahead of the "
                                    "load, for the rate forecast one cold start ahead", labels=["role"])
        for role, n in self.policy.standby.items():
            standby.add_metric([role], n)
        start = GaugeMetricFamily("pdserve_autoscaler_start_seconds", "what the planner counts for a new "
                                  "instance (cold) and a flip (rebuild, drain not included)", labels=["kind"])
        start.add_metric(["cold"], self.profile.startup_s)
        start.add_metric(["flip"], self.profile.flip_s)
        return [ttft, standby, start]

    def describe(self):
        return []


def create_autoscaler(cluster, spec) -> Autoscaler:
    """The autoscaler the spec asks for (`autoscale_*` keys), not yet started."""
    limits = ScalingLimits.from_spec(spec)
    profile = Profile.load(spec.autoscale_profile) if spec.autoscale_profile else None
    policy, actuator = create_policy(spec, profile, limits), create_actuator(cluster, spec)
    online = OnlineProfile(spec.max_num_seqs) if isinstance(policy, SLOPlanner) and profile is None else None
    times = profile or Profile  # (the class: its defaults, the times assumed until measured)
    logger.info("autoscaler: %s policy, %s actuator, every %.0f s, pools %d-%d prefill, %d-%d decode, %s instances "
                "in all, %s forecast; a cold start counts %.1f s and a flip %.2f s until one is measured (%s)",
                spec.autoscale_policy, spec.autoscale_actuator, spec.autoscale_interval_s, limits.min_prefill,
                limits.max_prefill, limits.min_decode, limits.max_decode, limits.max_instances or "any",
                spec.autoscale_forecast, times.startup_s, times.flip_s, "the profile's" if profile else "assumed")
    return Autoscaler(cluster, policy, actuator, spec.autoscale_interval_s, profile, online)
