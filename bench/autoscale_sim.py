"""Discrete-time simulation of the prefill and decode pools under a load trace, driven by an
autoscaling policy with a measured profile: does the policy follow the load, without
oscillating, and meet the SLOs? `python -m bench.autoscale_sim --profile bench/profiles/smollm2-cpu.json`

Model (tick `dt`): Poisson arrivals at the trace's rate -> admission (a decode instance with a free
slot and KV for prompt + output reserves it) -> the least-queued ready prefill instance computes the
prompt at the profile's tokens/s (FIFO) -> first token (TTFT) -> the decode instance generates the
rest at itl(batch) per token. New instances serve `startup_s` after they are asked for; a shrinking
pool drains its least loaded instance (no new work, leaves when empty). A request meets the SLO
when its TTFT and its mean time between tokens are both within target.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscaler import Observation, Policy, Profile, QueueThreshold, ScalingLimits, SLOPlanner


@dataclass(frozen=True)
class Phase:
    duration_s: float
    start_rate: float  # requests/s, as a multiple of one prefill instance's capacity
    end_rate: float


# ramp up, hold, spike, fall back, quiet: rates in units of one prefill instance's capacity
STANDARD_TRACE = (Phase(120, 0.3, 0.3), Phase(300, 0.3, 2.4), Phase(120, 2.4, 2.4), Phase(60, 3.6, 3.6),
                  Phase(120, 2.4, 2.4), Phase(300, 2.4, 0.3), Phase(240, 0.3, 0.3))


@dataclass
class _Req:
    arrival: float
    decode: "_Instance | None" = None
    ttft: float | None = None
    tokens_left: float = 0.0
    itl_sum: float = 0.0
    tokens: float = 0.0
    done_at: float | None = None


@dataclass
class _Instance:
    ready_at: float
    draining: bool = False
    queue: deque = field(default_factory=deque)  # prefill: [request, tokens left]
    running: list = field(default_factory=list)  # decode: requests generating
    reserved_tokens: float = 0.0  # decode: KV held by admitted requests

    def ready(self, t: float) -> bool:
        return t >= self.ready_at and not self.draining


@dataclass
class SimResult:
    attainment: float  # fraction of requests meeting both SLOs
    ttft_p99_s: float
    tbt_p99_s: float
    changes: int  # pool size changes decided
    reversals: int  # a pool turning from growing to shrinking or back (oscillation shows here)
    instance_seconds: float
    timeline: list  # (t, rate, prefill, decode)
    num_requests: int


def _arrivals(trace, base_rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals with a piecewise-linear rate (thinning)."""
    out, t0 = [], 0.0
    for ph in trace:
        peak = max(ph.start_rate, ph.end_rate) * base_rate
        t = t0
        while peak > 0:
            t += rng.expovariate(peak)
            if t >= t0 + ph.duration_s:
                break
            rate = (ph.start_rate + (ph.end_rate - ph.start_rate) * (t - t0) / ph.duration_s) * base_rate
            if rng.random() < rate / peak:
                out.append(t)
        t0 += ph.duration_s
    return out


def _rate_at(trace, t: float) -> float:
    t0 = 0.0
    for ph in trace:
        if t < t0 + ph.duration_s:
            return ph.start_rate + (ph.end_rate - ph.start_rate) * (t - t0) / ph.duration_s
        t0 += ph.duration_s
    return 0.0


def simulate(policy: Policy, profile: Profile, trace=STANDARD_TRACE, prompt_tokens: int = 512, output_tokens: int = 64,
             ttft_slo_s: float = 4.0, tbt_slo_s: float = 0.3, start: PoolSizes = PoolSizes(1, 1),
             interval_s: float = 10.0, dt: float = 0.1, seed: int = 0) -> SimResult:
    base_rate = profile.prefill_tokens_per_s / prompt_tokens  # requests/s one prefill instance sustains
    reqs = [_Req(a) for a in _arrivals(trace, base_rate, random.Random(seed))]
    end_s = sum(ph.duration_s for ph in trace)
    pools = {"prefill": [_Instance(0.0) for _ in range(start.prefill)],
             "decode": [_Instance(0.0) for _ in range(start.decode)]}
    kv_per_req = prompt_tokens + output_tokens
    waiting, next_arrival, arrived_since = deque(), 0, 0
    timeline, changes, instance_s, t, next_decision = [], 0, 0.0, 0.0, interval_s
    while t < end_s or any(r.done_at is None for r in reqs[:next_arrival]):
        if t > end_s + 600:
            break  # a policy that never catches up: the rest count as misses
        while next_arrival < len(reqs) and reqs[next_arrival].arrival <= t:
            waiting.append(reqs[next_arrival])
            next_arrival += 1
            arrived_since += 1
        _admit(waiting, pools, profile, kv_per_req, prompt_tokens, t)
        _run_prefill(pools["prefill"], profile, output_tokens, t, dt)
        _run_decode(pools["decode"], profile, kv_per_req, t, dt)
        for role in pools:
            pools[role] = [i for i in pools[role] if not (i.draining and not i.queue and not i.running
                                                          and i.reserved_tokens <= 0)]
            instance_s += len(pools[role]) * dt
        if t >= next_decision:
            sizes = PoolSizes(*(sum(not i.draining for i in pools[r]) for r in ("prefill", "decode")))
            decode = [i for i in pools["decode"] if not i.draining]
            obs = Observation(
                now=t, sizes=sizes, arrival_rate=arrived_since / interval_s, mean_prompt_tokens=prompt_tokens,
                mean_uncached_tokens=prompt_tokens, mean_output_tokens=output_tokens,
                queued_prefill_tokens=sum(left for i in pools["prefill"] for _, left in i.queue),
                decode_running=sum(len(i.running) for i in decode), decode_waiting=len(waiting),
                decode_kv_usage=sum(i.reserved_tokens for i in decode) / max(len(decode), 1) / profile.kv_capacity_tokens)
            target = policy.decide(obs)
            changes += _apply(pools, sizes, target, t + profile.startup_s)
            arrived_since, next_decision = 0, next_decision + interval_s
            timeline.append((round(t, 1), _rate_at(trace, t) * base_rate, target.prefill, target.decode))
        t += dt
    return _result(reqs, ttft_slo_s, tbt_slo_s, changes, instance_s, timeline)


def _admit(waiting, pools, profile, kv_per_req, prompt_tokens, t) -> None:
    while waiting:
        decodes = [i for i in pools["decode"] if i.ready(t) and len(i.running) + _n_reserved(i, pools) <
                   profile.max_num_seqs and i.reserved_tokens + kv_per_req <= profile.kv_capacity_tokens]
        prefills = [i for i in pools["prefill"] if i.ready(t)]
        if not decodes or not prefills:
            return
        req = waiting.popleft()
        req.decode = min(decodes, key=lambda i: i.reserved_tokens)
        req.decode.reserved_tokens += kv_per_req
        min(prefills, key=lambda i: sum(left for _, left in i.queue)).queue.append([req, float(prompt_tokens)])


def _n_reserved(inst, pools) -> int:
    return sum(1 for p in pools["prefill"] for r, _ in p.queue if r.decode is inst)


def _run_prefill(prefills, profile, output_tokens, t, dt) -> None:
    for inst in prefills:
        budget = profile.prefill_tokens_per_s * dt if t >= inst.ready_at else 0.0
        while inst.queue and budget > 0:
            item = inst.queue[0]
            used = min(budget, item[1])
            item[1] -= used
            budget -= used
            if item[1] <= 0:
                req = inst.queue.popleft()[0]
                req.ttft = t + dt - req.arrival
                req.tokens_left = output_tokens - 1
                req.decode.running.append(req)


def _run_decode(decodes, profile, kv_per_req, t, dt) -> None:
    for inst in decodes:
        if not inst.running:
            continue
        itl = profile.itl(len(inst.running))
        for req in inst.running:
            step = dt / itl
            req.tokens_left -= step
            req.tokens += step
            req.itl_sum += itl * step
            if req.tokens_left <= 0:
                req.done_at = t + dt
        for req in [r for r in inst.running if r.done_at is not None]:
            inst.running.remove(req)
            inst.reserved_tokens -= kv_per_req


def _apply(pools, sizes: PoolSizes, target: PoolSizes, ready_at: float) -> int:
    changes = 0
    for role in ("prefill", "decode"):
        diff = getattr(target, role) - getattr(sizes, role)
        changes += diff != 0
        for _ in range(diff):
            pools[role].append(_Instance(ready_at))
        live = [i for i in pools[role] if not i.draining]
        for inst in sorted(live, key=lambda i: len(i.queue) + len(i.running) + i.reserved_tokens)[:max(0, -diff)]:
            inst.draining = True
    return changes


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.inf
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _result(reqs, ttft_slo_s, tbt_slo_s, changes, instance_s, timeline) -> SimResult:
    inf = math.inf
    ttft = [r.ttft if r.ttft is not None else inf for r in reqs]
    tbt = [r.itl_sum / r.tokens if r.tokens else (0.0 if r.done_at else inf) for r in reqs]
    met = sum(1 for a, b in zip(ttft, tbt) if a <= ttft_slo_s and b <= tbt_slo_s)
    return SimResult(met / max(len(reqs), 1), _pct(ttft, 0.99), _pct(tbt, 0.99), changes, _reversals(timeline),
                     instance_s, timeline, len(reqs))


def _reversals(timeline) -> int:
    out = 0
    for col in (2, 3):
        steps = [b[col] - a[col] for a, b in zip(timeline, timeline[1:]) if b[col] != a[col]]
        out += sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="JSON written by `pdserve bench --profile`")
    ap.add_argument("--ttft-slo", type=float, default=4.0)
    ap.add_argument("--tbt-slo", type=float, default=0.3)
    ap.add_argument("--json", help="write both results (with timelines) here")
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    limits = ScalingLimits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, headroom=0.2,
                           scale_up_cooldown_s=10, scale_down_cooldown_s=60)
    results = {"slo_planner": simulate(SLOPlanner(profile, limits, args.ttft_slo, args.tbt_slo), profile,
                                       ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo),
               "queue_threshold": simulate(QueueThreshold(limits), profile, ttft_slo_s=args.ttft_slo,
                                           tbt_slo_s=args.tbt_slo)}
    print(f"{'policy':<16}{'SLO met':>9}{'TTFT p99':>10}{'TBT p99':>9}{'changes':>9}{'reversals':>10}{'inst-s':>9}"
          "  requests")
    for name, r in results.items():
        print(f"{name:<16}{r.attainment:>9.1%}{r.ttft_p99_s:>9.1f}s{r.tbt_p99_s:>8.3f}s{r.changes:>9}{r.reversals:>10}"
              f"{r.instance_seconds:>9.0f}  {r.num_requests}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: vars(v) for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
