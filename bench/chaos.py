"""Chaos: faults together, under load, on the Helm chart's pods on the multi-host bed.

    python -m bench.chaos --duration 600 --seed 1 --json --log chaos.json     # needs root

For `--duration` seconds, client threads stream chat and completion requests through every
gateway (bench/chaos_load.py: mixed prompt lengths, some n = 2, some hung up by their client)
while a seeded schedule injects faults (bench/chaos_faults.py: pods, ranks, Redis, links), now
and then two at once; a kubelet restarts any pod whose container exited. After each fault is
healed the run waits until the cluster is back at its spec and records how long that took.

Invariants (a broken one is a violation, in the log and counted in the summary):
- every request completes with exactly the colocated greedy text in each choice, or ends with an
  explicit error, within `--deadline` seconds: never a hang, never a stream that stops without an
  error or a finish reason (chaos_load.VIOLATIONS);
- after the faults stop, the cluster returns to its spec (every instance healthy, every gateway
  ready and serving) within `--recover-timeout`;
- then every instance's KV usage, running and waiting return to zero;
- no pod's resident memory grows past MEMORY_BOUND over its first sample at spec.
`--json` prints one summary object on stdout (`faults_injected`, `violations`, ...); `--log`
writes every fault, request and violation.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench import multihost_net as net
from bench.chaos_faults import FAULT_KINDS, Fault, Injector, Kubelet
from bench.chaos_load import PROMPTS, VIOLATIONS, Load, reference_texts
from bench.chart_pods import BED_AUTH, ChartPods

logger = logging.getLogger(__name__)
MEMORY_BOUND = (1.5, 512.0)  # a pod may reach 1.5 x its first sample at spec + 512 MiB


@dataclass
class ChaosConfig:
    duration_s: float = 120.0
    seed: int = 0
    concurrency: int = 3
    deadline_s: float = 180.0  # a request ends (finished or with an error) within this
    recover_timeout_s: float = 300.0
    gap_s: tuple[float, float] = (3.0, 10.0)  # between a fault's recovery and the next fault
    overlap: float = 0.3  # the chance that two faults are injected together
    kinds: tuple[str, ...] = FAULT_KINDS
    num_prefill: int = 1
    num_decode: int = 1
    headers: dict = field(default_factory=lambda: dict(BED_AUTH))  # the gateways' API key


class Chaos:
    """One run on running `pods` (the chart's BED_VALUES or alike); `run()` returns the log."""

    def __init__(self, pods: ChartPods, config: ChaosConfig, references: dict | None = None):
        self.pods, self.config = pods, config
        self.references = references if references is not None else reference_texts()
        self.rng = random.Random(config.seed)
        self.kubelet = Kubelet(pods)
        self.injector = Injector(pods, self.kubelet, self.controller_url)
        self.faults: list[Fault] = []
        self.violations: list[dict] = []
        self.memory: dict[str, dict] = {}
        self.t0 = time.monotonic()

    def controller_url(self) -> str:
        return self.pods.url(self.injector.of("controller")[0])

    def gateways(self) -> dict[str, str]:
        return {n: self.pods.url(n) for n in self.injector.of("gateway")
                if self.pods.running(n) and n not in self.injector.terminating}

    def run(self) -> dict:
        load = Load(self.gateways, self.references, self.config.concurrency, self.config.seed,
                    self.config.deadline_s, headers=self.config.headers).start()
        try:
            self._wait_at_spec("the start")
            self._sample_memory(baseline=True)
            end = time.monotonic() + self.config.duration_s
            while time.monotonic() < end:
                self._pause(self.rng.uniform(*self.config.gap_s))
                self._fault_round()
                self._sample_memory()
            recovered = self._wait_at_spec("the end")
        finally:
            stuck = load.stop(self.config.deadline_s + 30)
        if stuck:
            self._violate("hang", f"client threads still waiting past the deadline: {stuck}")
        if recovered:
            self._check_kv_zero()
            self._sample_memory(final=True)
        return self._log(load)

    def _fault_round(self) -> None:
        kinds = [self.rng.choice(self.config.kinds)]
        if self.rng.random() < self.config.overlap:
            kinds.append(self.rng.choice(self.config.kinds))
        rngs = [random.Random(self.rng.random()) for _ in kinds]
        with cf.ThreadPoolExecutor(len(kinds)) as pool:
            futures = [pool.submit(self.injector.inject, k, r) for k, r in zip(kinds, rngs)]
            while not all(f.done() for f in futures):
                self._pause(0.5)
            faults = [f.result() for f in futures]
        logger.info("chaos: injected %s", ", ".join(f"{f.kind} on {f.target}" for f in faults))
        for f in faults:
            if f.violation:
                self._violate(f.kind, f"{f.target}: {f.violation}")
        if self._wait_at_spec(" + ".join(f.kind for f in faults)):
            for f in faults:
                f.recovered_at = time.monotonic()
        self.faults += faults

    def at_spec(self) -> bool:
        """Every instance of the spec healthy on the controller and on every gateway, and each
        gateway serving a request with the colocated text."""
        try:
            status = httpx.get(self.controller_url() + "/status", timeout=5).json()["instances"]
            healthy = {i["instance_id"] for i in status if i["healthy"] and not i["draining"]}
            roles = [i["role"] for i in status if i["instance_id"] in healthy]
            if (roles.count("prefill"), roles.count("decode")) != (self.config.num_prefill, self.config.num_decode):
                return False
            gateways = self.gateways()
            if len(gateways) != len(self.injector.of("gateway")):
                return False
            for url in gateways.values():
                seen = httpx.get(url + "/status", headers=self.config.headers, timeout=5).json()["instances"]
                if {i["instance_id"] for i in seen if i["healthy"]} != healthy or not self._probe(url):
                    return False
            return True
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def _probe(self, url: str) -> bool:
        body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, headers=self.config.headers, timeout=60)
        return r.status_code == 200 and r.json()["choices"][0]["text"] == self.references[("completion", PROMPTS[0], 8)]

    def _pause(self, seconds: float) -> None:
        """Sleeps `seconds`, the kubelet ticking (on this thread: see chaos_faults.Kubelet)."""
        end = time.monotonic() + seconds
        while True:
            self.kubelet.tick()
            if time.monotonic() >= end:
                return
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def _wait_at_spec(self, after: str) -> bool:
        deadline = time.monotonic() + self.config.recover_timeout_s
        while time.monotonic() < deadline:
            self.kubelet.tick()
            if self.at_spec():
                return True
            self._pause(1.0)
        self._violate("not_at_spec", f"not back at spec {self.config.recover_timeout_s:.0f} s after {after}")
        return False

    def _check_kv_zero(self, timeout: float = 60.0) -> None:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self.controller_url() + "/status", timeout=5).json()["instances"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last = f"controller: {exc!r}"
            else:
                last = {i["instance_id"]: {k: i["load"].get(k, 0) for k in ("running", "waiting", "kv_usage")}
                        for i in status}
                if all(v == 0 for load in last.values() for v in load.values()):
                    return
            self._pause(1.0)
        self._violate("kv_not_freed", f"{timeout:.0f} s after the load stopped: {last}")

    def _sample_memory(self, baseline: bool = False, final: bool = False) -> None:
        """RSS (MiB) of every pod's processes; a pod's baseline is its first sample at spec (and
        again after it restarted: its restarts are kubelet.restarts)."""
        for name in self.pods.pods:
            host = self.pods.bed.hosts.get(name)
            if host is None or not self.pods.running(name):
                continue
            rss = sum(_rss_mib(pid) for pid in net.netns_pids(host.link.netns))
            entry = self.memory.get(name)
            if entry is None or entry["init_pid"] != host.init_pid:  # new, or restarted since
                entry = self.memory[name] = {"init_pid": host.init_pid, "baseline_mib": rss, "peak_mib": rss}
            entry["peak_mib"], entry["last_mib"] = max(entry["peak_mib"], rss), rss
            if final and rss > MEMORY_BOUND[0] * entry["baseline_mib"] + MEMORY_BOUND[1]:
                self._violate("memory", f"{name}: {rss:.0f} MiB at the end, baseline {entry['baseline_mib']:.0f}")

    def _violate(self, kind: str, detail: str) -> None:
        logger.warning("chaos violation %s: %s", kind, detail)
        self.violations.append({"kind": kind, "detail": detail, "at": round(time.monotonic() - self.t0, 3)})

    def _excuse_cuts(self, load: Load) -> None:
        """A connection cut with no error said is an explicit error only when its gateway was
        SIGKILLed while the request ran (nothing was left to say it); else a violation."""
        for r in load.records:
            if r.outcome == "cut" and any(pod == r.gateway and r.sent_at <= t <= r.ended_at + 1.0
                                          for pod, t in self.injector.sigkills):
                r.outcome, r.detail = "error", f"its gateway was SIGKILLed: {r.detail}"

    def _log(self, load: Load) -> dict:
        self._excuse_cuts(load)
        requests = [r.summary(self.t0) for r in load.records]
        self.violations += [{"kind": r["outcome"], "detail": r["detail"], "request": r["id"], "at": r["ended_at"]}
                            for r in requests if r["outcome"] in VIOLATIONS]
        return {"summary": summarize(self.faults, requests, self.violations, self.config),
                "faults": [f.summary(self.t0) for f in self.faults], "violations": self.violations,
                "memory": self.memory, "requests": requests}


def summarize(faults: list[Fault], requests: list[dict], violations: list[dict], config: ChaosConfig) -> dict:
    by_kind: dict[str, list] = {}
    for f in faults:
        by_kind.setdefault(f.kind, []).append(f)
    recovery = {k: sorted(round(f.recovered_at - f.started_at, 1) for f in fs if f.recovered_at)
                for k, fs in by_kind.items()}
    outcomes: dict[str, int] = {}
    for r in requests:
        outcomes[r["outcome"] or "in_flight"] = outcomes.get(r["outcome"] or "in_flight", 0) + 1
    return {"duration_s": config.duration_s, "seed": config.seed, "faults_injected": len(faults),
            "faults_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
            "faults_failed_to_inject": sum(1 for f in faults if f.error),
            "recovery_s_by_kind": dict(sorted(recovery.items())), "requests": len(requests),
            "requests_by_outcome": dict(sorted(outcomes.items())), "violations": len(violations),
            "violations_by_kind": _count(v["kind"] for v in violations)}


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # exited meanwhile
        pass
    return 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults under load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=3, help="client threads")
    p.add_argument("--deadline", type=float, default=180.0, help="a request must end within this (s)")
    p.add_argument("--recover-timeout", type=float, default=300.0, help="to be back at spec after a fault (s)")
    p.add_argument("--faults", nargs="+", choices=FAULT_KINDS, default=list(FAULT_KINDS), help="kinds to inject")
    p.add_argument("--json", action="store_true", help="print one summary object on stdout")
    p.add_argument("--log", help="write the whole log (faults, requests, violations) to this JSON file")
    args = p.parse_args(argv)
    for name in ("duration", "deadline", "recover_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.concurrency < 1:
        p.error(f"--concurrency must be at least 1, got {args.concurrency}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe and status poll otherwise
    from bench.chart_pods import BED_VALUES
    from bench.multihost import Bed
    config = ChaosConfig(args.duration, args.seed, args.concurrency, args.deadline, args.recover_timeout,
                         kinds=tuple(args.faults))
    references = reference_texts()  # before the bed: the model loads on a quiet machine
    with Bed([]) as bed:
        pods = ChartPods(bed, BED_VALUES, release="chaos")
        try:
            log = Chaos(pods.up(timeout=600), config, references).run()
        finally:
            pods.down()
    if args.log:
        with open(args.log, "w") as f:
            json.dump(log, f, indent=1)
    print(json.dumps(log["summary"], indent=None if args.json else 1))
    return 0 if log["summary"]["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
