"""Discrete-time simulation of the prefill and decode pools under a load trace, driven by an
autoscaling policy with a measured profile: does the policy follow the load, without
oscillating, and meet the SLOs? `python -m bench.autoscale_sim --profile bench/profiles/smollm2-cpu.json`

Model (tick `dt`): Poisson arrivals at the trace's rate -> admission (a decode instance with a free
slot and KV for prompt + output reserves it) -> the least-queued ready prefill instance computes the
prompt at the profile's tokens/s (FIFO) -> first token (TTFT) -> the decode instance generates the
rest at itl(batch) per token. New instances serve `startup_s` after they are asked for; a shrinking
pool drains its least loaded instance (no new work, leaves when empty). With `flips`, a decision that
grows one pool and shrinks the other flips instances instead, as RayActuator does: the shrinking
pool's least loaded instance drains, then serves in the other role `flip_s` later. A request meets
the SLO when its TTFT and its mean time between tokens are both within target. A phase may set its
own request shape (prompt and output tokens): bench/shifting_mix.py runs a trace whose mix shifts.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscaler import Observation, Policy, Profile, QueueThreshold, ScalingLimits, SLOPlanner
from cluster.autoscale.forecast import LinearTrend

WINDOW_S = 10.0  # SimResult.windows: SLO attainment of the requests arriving in each


@dataclass(frozen=True)
class Phase:
    duration_s: float
    start_rate: float  # requests/s, as a multiple of one prefill instance's capacity (at the default prompt)
    end_rate: float
    prompt_tokens: int | None = None  # None: simulate()'s
    output_tokens: int | None = None


# ramp up, hold, spike, fall back, quiet: rates in units of one prefill instance's capacity
STANDARD_TRACE = (Phase(120, 0.3, 0.3), Phase(300, 0.3, 2.4), Phase(120, 2.4, 2.4), Phase(60, 3.6, 3.6),
                  Phase(120, 2.4, 2.4), Phase(300, 2.4, 0.3), Phase(240, 0.3, 0.3))


@dataclass
class _Req:
    arrival: float
    prompt: int = 0
    output: int = 0
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
    becomes: "_Instance | None" = None  # a flipping instance: the other role's, ready flip_s after it drains
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
    windows: list = field(default_factory=list)  # (start s, requests arriving in the next 10 s, fraction met)
    moves: dict = field(default_factory=dict)  # instances flipped, added, removed (the policy's counts)


def _arrivals(trace, base_rate: float, rng: random.Random, prompt_tokens: int, output_tokens: int) -> list[_Req]:
    """Poisson arrivals with a piecewise-linear rate (thinning), each with its phase's shape."""
    out, t0 = [], 0.0
    for ph in trace:
        peak = max(ph.start_rate, ph.end_rate) * base_rate
        shape = (ph.prompt_tokens or prompt_tokens, ph.output_tokens or output_tokens)
        t = t0
        while peak > 0:
            t += rng.expovariate(peak)
            if t >= t0 + ph.duration_s:
                break
            rate = (ph.start_rate + (ph.end_rate - ph.start_rate) * (t - t0) / ph.duration_s) * base_rate
            if rng.random() < rate / peak:
                out.append(_Req(t, *shape))
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
             interval_s: float = 10.0, dt: float = 0.1, seed: int = 0, flips: bool = False) -> SimResult:
    """`flips`: a decision that grows one pool and shrinks the other flips instances (RayActuator's way)."""
    base_rate = profile.prefill_tokens_per_s / prompt_tokens  # requests/s one prefill instance sustains
    reqs = _arrivals(trace, base_rate, random.Random(seed), prompt_tokens, output_tokens)
    end_s = sum(ph.duration_s for ph in trace)
    pools = {"prefill": [_Instance(0.0) for _ in range(start.prefill)],
             "decode": [_Instance(0.0) for _ in range(start.decode)]}
    waiting, seen = deque(), _Seen(prompt_tokens, output_tokens)
    timeline, changes, instance_s, t, next_decision = [], 0, 0.0, 0.0, interval_s
    while t < end_s or any(r.done_at is None for r in reqs[:seen.arrived]):
        if t > end_s + 600:
            break  # a policy that never catches up: the rest count as misses
        while seen.arrived < len(reqs) and reqs[seen.arrived].arrival <= t:
            waiting.append(reqs[seen.arrived])
            seen.arrive(reqs[seen.arrived])
        _admit(waiting, pools, profile, t)
        _run_prefill(pools["prefill"], profile, t, dt)
        seen.done(_run_decode(pools["decode"], profile, t, dt))
        for role in pools:
            pools[role] = _settle(pools[role], t, profile.flip_s)
            instance_s += sum(i.ready_at != math.inf for i in pools[role]) * dt  # (not a flip's other half yet)
        if t >= next_decision:
            sizes = PoolSizes(*(sum(not i.draining for i in pools[r]) for r in ("prefill", "decode")))
            target = policy.decide(seen.observe(t, sizes, pools, waiting, interval_s, profile))
            changes += _apply(pools, sizes, target, t + profile.startup_s, flips)
            next_decision += interval_s
            timeline.append((round(t, 1), _rate_at(trace, t) * base_rate, target.prefill, target.decode))
        t += dt
    return _result(reqs, ttft_slo_s, tbt_slo_s, changes, instance_s, timeline, dict(policy.moves))


class _Seen:
    """What the autoscaler's LoadWindow sees: arrivals and their prompts per interval, the outputs of
    the requests that completed (the last known shape while none did)."""

    def __init__(self, prompt_tokens: int, output_tokens: int):
        self.arrived, self.count, self.prompt_sum, self.outputs = 0, 0, 0.0, []
        self.shape = [float(prompt_tokens), float(output_tokens)]

    def arrive(self, req: _Req) -> None:
        self.arrived, self.count, self.prompt_sum = self.arrived + 1, self.count + 1, self.prompt_sum + req.prompt

    def done(self, reqs: list[_Req]) -> None:
        self.outputs.extend(r.output for r in reqs)

    def observe(self, t, sizes, pools, waiting, interval_s, profile) -> Observation:
        if self.count:
            self.shape[0] = self.prompt_sum / self.count
        if self.outputs:
            self.shape[1] = sum(self.outputs) / len(self.outputs)
        decode = [i for i in pools["decode"] if not i.draining and t >= i.ready_at]
        obs = Observation(
            now=t, sizes=sizes, arrival_rate=self.count / interval_s, mean_prompt_tokens=self.shape[0],
            mean_uncached_tokens=self.shape[0], mean_output_tokens=self.shape[1],
            queued_prefill_tokens=sum(left for i in pools["prefill"] for _, left in i.queue),
            decode_running=sum(len(i.running) for i in decode), decode_waiting=len(waiting),
            decode_kv_usage=sum(i.reserved_tokens for i in decode) / max(len(decode), 1) / profile.kv_capacity_tokens)
        self.count, self.prompt_sum, self.outputs = 0, 0.0, []
        return obs


def _admit(waiting, pools, profile, t) -> None:
    while waiting:
        kv = waiting[0].prompt + waiting[0].output
        decodes = [i for i in pools["decode"] if i.ready(t) and len(i.running) + _n_reserved(i, pools) <
                   profile.max_num_seqs and i.reserved_tokens + kv <= profile.kv_capacity_tokens]
        prefills = [i for i in pools["prefill"] if i.ready(t)]
        if not decodes or not prefills:
            return
        req = waiting.popleft()
        req.decode = min(decodes, key=lambda i: i.reserved_tokens)
        req.decode.reserved_tokens += kv
        min(prefills, key=lambda i: sum(left for _, left in i.queue)).queue.append([req, float(req.prompt)])


def _n_reserved(inst, pools) -> int:
    return sum(1 for p in pools["prefill"] for r, _ in p.queue if r.decode is inst)


def _run_prefill(prefills, profile, t, dt) -> None:
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
                req.tokens_left = req.output - 1
                req.decode.running.append(req)


def _run_decode(decodes, profile, t, dt) -> list[_Req]:
    """One tick of every decode instance; the requests that finished."""
    finished = []
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
            inst.reserved_tokens -= req.prompt + req.output
            finished.append(req)
    return finished


def _settle(pool: list[_Instance], t: float, flip_s: float) -> list[_Instance]:
    """Drained instances leave; a flipping one's other half serves `flip_s` after."""
    keep = []
    for inst in pool:
        if inst.draining and not inst.queue and not inst.running and inst.reserved_tokens <= 0:
            if inst.becomes is not None:
                inst.becomes.ready_at = t + flip_s
            continue
        keep.append(inst)
    return keep


def _apply(pools, sizes: PoolSizes, target: PoolSizes, ready_at: float, flips: bool) -> int:
    changes, diff = 0, {role: getattr(target, role) - getattr(sizes, role) for role in pools}
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        for inst in _least_loaded(pools[src])[:max(0, min(-diff[src], diff[dst])) if flips else 0]:
            inst.draining, inst.becomes = True, _Instance(math.inf)
            pools[dst].append(inst.becomes)
            diff[src], diff[dst] = diff[src] + 1, diff[dst] - 1
            changes += 1
    for role in pools:
        changes += diff[role] != 0
        for _ in range(diff[role]):
            pools[role].append(_Instance(ready_at))
        for inst in _least_loaded(pools[role])[:max(0, -diff[role])]:
            inst.draining = True
    return changes


def _least_loaded(pool: list[_Instance]) -> list[_Instance]:
    live = [i for i in pool if not i.draining]
    return sorted(live, key=lambda i: len(i.queue) + len(i.running) + i.reserved_tokens)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.inf
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _result(reqs, ttft_slo_s, tbt_slo_s, changes, instance_s, timeline, moves) -> SimResult:
    inf = math.inf
    ttft = [r.ttft if r.ttft is not None else inf for r in reqs]
    tbt = [r.itl_sum / r.tokens if r.tokens else (0.0 if r.done_at else inf) for r in reqs]
    ok = [a <= ttft_slo_s and b <= tbt_slo_s for a, b in zip(ttft, tbt)]
    windows: dict[int, list[bool]] = {}
    for req, met in zip(reqs, ok):
        windows.setdefault(int(req.arrival // WINDOW_S), []).append(met)
    return SimResult(sum(ok) / max(len(reqs), 1), _pct(ttft, 0.99), _pct(tbt, 0.99), changes, _reversals(timeline),
                     instance_s, timeline, len(reqs),
                     [(k * WINDOW_S, len(v), sum(v) / len(v)) for k, v in sorted(windows.items())], moves)


def recovered_after(result: SimResult, t0: float, level: float = 0.9, runs: int = 3) -> float:
    """Seconds from `t0` until `runs` windows in a row of arriving requests meet the SLO at `level`
    (inf: never)."""
    after = [(start, frac) for start, _, frac in result.windows if start >= t0]
    for k in range(len(after) - runs + 1):
        if all(frac >= level for _, frac in after[k:k + runs]):
            return after[k][0] - t0
    return math.inf


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
    ap.add_argument("--startup-s", type=float, help="the cold start to simulate (default: the profile's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results (with timelines) here")
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    if args.startup_s is not None:
        profile = replace(profile, startup_s=args.startup_s)
    limits = ScalingLimits(min_prefill=1, max_prefill=6, min_decode=1, max_decode=6, headroom=0.2,
                           scale_up_cooldown_s=10, scale_down_cooldown_s=60)
    slos = dict(ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo, seed=args.seed)
    policies = {"slo_planner": SLOPlanner(profile, limits, args.ttft_slo, args.tbt_slo),
                "slo_trend": SLOPlanner(profile, limits, args.ttft_slo, args.tbt_slo, forecaster=LinearTrend(10.0)),
                "queue_threshold": QueueThreshold(limits)}
    results = {name: simulate(policy, profile, **slos) for name, policy in policies.items()}
    print(f"cold start {profile.startup_s:.1f} s; slo_planner: the rate now; slo_trend: the trend forecast")
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
