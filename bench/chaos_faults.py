"""The chaos run's faults (bench/chaos.py) on the Helm chart's pods (bench/chart_pods.py), and the
kubelet that restarts a pod whose container exited, as Kubernetes would (ChartPods restarts none).

Kinds (FAULT_KINDS) and how each heals:
- kill_gateway, kill_controller, kill_prefill_host, kill_decode_host: every process of the pod
  SIGKILLed (a host lost); held down a few seconds, then the kubelet starts its container again.
- kill_prefill_rank, kill_decode_rank: the instance's rank process SIGKILLed, its pod left up;
  the controller must replace the instance.
- restart_redis: Redis killed; the kubelet starts it again, empty (no persistence, as the chart runs it).
- restart_ray_head: the Ray head's pod killed; the kubelet starts it again: a new, empty Ray
  cluster (no GCS fault tolerance). Worker pods' `ray start --block` exits and they restart;
  the controller and the gateways find their node gone and exit (cluster/control/ray_watch.py),
  then join the new cluster, where the controller starts the instances again.
- cut_link: a worker's, Redis' or the controller's link drops every packet for a few seconds.
- slow_link: the same links shaped to 1 Mbit/s both ways for a while (`Bed.slow_link`).
- rollout_gateway: a gateway pod ended as a rollout ends it (`ChartPods.terminate_pod`: its
  preStop hook, SIGTERM, SIGKILL past the grace period), its clients sent elsewhere from the
  start (the Service drops a terminating pod); then the kubelet starts it again (the new pod).
  Exiting only at SIGKILL is a violation: the drain must end within the grace period.
- router_fault: SIGUSR2 to a gateway (its pods run with PDSERVE_FAILPOINTS=sigusr2,
  router/failures.py): the next event one of its router handlers takes raises; the guard must
  fail that request alone (an explicit error) and count it. Injected once its count rose.
Not injected: cut gateway links (a client cut off from its gateway cannot be told anything:
nothing to check).
"""
from __future__ import annotations

import logging
import random
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass

import httpx

from bench.chart_pods import BED_AUTH, ChartPods

logger = logging.getLogger(__name__)

FAULT_KINDS = ("kill_gateway", "kill_controller", "kill_prefill_host", "kill_decode_host", "kill_prefill_rank",
               "kill_decode_rank", "restart_redis", "cut_link", "slow_link", "rollout_gateway", "router_fault",
               "restart_ray_head")
KILLED_POD = {"kill_gateway": "gateway", "kill_controller": "controller", "kill_prefill_host": "prefill",
              "kill_decode_host": "decode"}
LINK_TARGETS = ("prefill", "decode", "redis", "controller")


@dataclass
class Fault:
    kind: str
    target: str
    started_at: float
    healed_at: float | None = None
    recovered_at: float | None = None
    error: str = ""  # it could not be injected
    violation: str = ""  # what the cluster did wrong while it was injected (the run counts it)

    def summary(self, t0: float) -> dict:
        d = asdict(self)
        for k in ("started_at", "healed_at", "recovered_at"):
            d[k] = None if d[k] is None else round(d[k] - t0, 3)
        d["recovery_s"] = None if self.recovered_at is None else round(self.recovered_at - self.started_at, 3)
        return d


class Kubelet:
    """Restarts, `delay_s` after it is seen exited, every pod's container that is not running and
    not held down by a fault, on each `tick()`. Every pod operation of the run takes `lock`.
    NOTE: ticks run on the main thread, and no fault starts a process that outlives it: a bed host
    dies with the thread that started it (PR_SET_PDEATHSIG, bench/multihost_net.py)."""

    def __init__(self, pods: ChartPods, delay_s: float = 2.0):
        self.pods, self.delay_s = pods, delay_s
        self.lock, self.held, self.restarts = threading.RLock(), set(), []
        self._seen_dead: dict[str, float] = {}

    def tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            for name in list(self.pods.pods):
                if name in self.held or self.pods.running(name):
                    self._seen_dead.pop(name, None)
                elif now - self._seen_dead.setdefault(name, now) >= self.delay_s:
                    logger.info("kubelet: %s exited, restarting it", name)
                    self._restart(name, now)

    def _restart(self, name: str, now: float) -> None:
        try:
            self.pods.restart_pod(name)
            self.restarts.append((name, now))
        except Exception as exc:  # the run sees a pod that never came back
            logger.warning("kubelet: restarting %s failed: %s", name, exc)
        self._seen_dead.pop(name, None)


class Injector:
    """Injects one fault of a kind on the pods and heals it (`inject`); the controller's /status
    (`controller_url()`), or a gateway's, names the ranks to kill."""

    def __init__(self, pods: ChartPods, kubelet: Kubelet, controller_url, hold_s: tuple[float, float] = (2.0, 8.0)):
        self.pods, self.kubelet, self.controller_url, self.hold_s = pods, kubelet, controller_url, hold_s
        self.terminating: set[str] = set()  # pods in a rollout's termination: no client is sent there
        self.sigkills: list[tuple[str, float]] = []  # (pod, when) every SIGKILL of a pod

    def of(self, component: str) -> list[str]:
        return sorted(n for n, c in self.pods.pods.items() if c == component)

    def inject(self, kind: str, rng: random.Random) -> Fault:
        """Injects, holds, heals; the Fault says what and when (its `error` if it could not)."""
        fault = Fault(kind, "", time.monotonic())
        try:
            getattr(self, "_" + kind.split("_", 1)[0])(kind, fault, rng)
        except Exception as exc:
            fault.error = f"{type(exc).__name__}: {exc}"[:300]
            logger.warning("chaos: %s on %s failed: %s", kind, fault.target or "?", fault.error)
        fault.healed_at = fault.healed_at or time.monotonic()
        return fault

    def _kill(self, kind: str, fault: Fault, rng: random.Random) -> None:
        if kind.endswith("_rank"):
            return self._kill_rank(kind.split("_")[1], fault, rng)
        fault.target = rng.choice(self.of(KILLED_POD[kind]))
        self._down_then_up(fault.target, rng.uniform(*self.hold_s))

    def _restart(self, kind: str, fault: Fault, rng: random.Random) -> None:
        fault.target = self.of("ray-head" if kind == "restart_ray_head" else "redis")[0]
        self._down_then_up(fault.target, 0.0)

    def _down_then_up(self, name: str, hold_s: float) -> None:
        """Killed, held down `hold_s`, then left to the kubelet to restart."""
        with self.kubelet.lock:
            self.kubelet.held.add(name)
            self.pods.kill_pod(name)
            self.sigkills.append((name, time.monotonic()))
        time.sleep(hold_s)
        self.kubelet.held.discard(name)

    def _status(self) -> list[dict]:
        """The instances as the controller lists them, else as a gateway does (the controller may
        be the other fault of this round)."""
        urls = [self.controller_url()] + [self.pods.url(g) for g in self.of("gateway")]
        for url in urls:
            try:
                return httpx.get(url + "/status", headers=BED_AUTH, timeout=10).json()["instances"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        raise RuntimeError(f"no /status answered: {urls}")

    def _kill_rank(self, role: str, fault: Fault, rng: random.Random) -> None:
        instances = self._status()
        ranks = [r for i in instances if i["role"] == role for r in i["ranks"]]
        rank = rng.choice(ranks)
        (pod,) = [n for n in self.pods.pods if self.pods.address(n) == rank["node_ip"]]
        fault.target = f"{pod}:pid {rank['pid']}"
        out = self.pods.bed.run(pod, ["kill", "-9", str(rank["pid"])], timeout=10)
        if out.returncode != 0:
            raise RuntimeError(f"kill -9 {rank['pid']} in {pod}: {out.stderr.strip()}")

    def _cut(self, kind: str, fault: Fault, rng: random.Random) -> None:
        fault.target = rng.choice([n for c in LINK_TARGETS for n in self.of(c)])
        self.pods.bed.cut_link(fault.target)
        try:
            time.sleep(rng.uniform(*self.hold_s))
        finally:
            self.pods.bed.restore_link(fault.target)

    def _slow(self, kind: str, fault: Fault, rng: random.Random) -> None:
        fault.target = rng.choice([n for c in LINK_TARGETS for n in self.of(c)])
        self.pods.bed.slow_link(fault.target, "1mbit")
        try:
            time.sleep(rng.uniform(self.hold_s[0] * 2, self.hold_s[1] * 2))
        finally:
            self.pods.bed.unslow_link(fault.target)

    def _rollout(self, kind: str, fault: Fault, rng: random.Random) -> None:
        fault.target = name = rng.choice(self.of("gateway"))
        with self.kubelet.lock:
            self.kubelet.held.add(name)
            self.terminating.add(name)
        try:
            if not self.pods.terminate_pod(name):
                with self.kubelet.lock:
                    self.pods.kill_pod(name)
                    self.sigkills.append((name, time.monotonic()))
                fault.violation = "the gateway outlived its grace period after SIGTERM: SIGKILLed"
        finally:
            with self.kubelet.lock:
                self.terminating.discard(name)
                self.kubelet.held.discard(name)

    def _router(self, kind: str, fault: Fault, rng: random.Random, timeout_s: float = 60.0) -> None:
        fault.target = name = rng.choice([g for g in self.of("gateway") if self.pods.running(g)])
        before = self._handler_errors(name)
        self.pods.signal_pod(name, signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        while self._handler_errors(name) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no router handler error counted on {name} {timeout_s:.0f} s after SIGUSR2")
            time.sleep(0.5)

    def _handler_errors(self, name: str) -> float:
        """The gateway's pdserve_router_handler_errors_total, all handlers (0 if it does not answer)."""
        try:
            text = httpx.get(self.pods.url(name) + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return 0.0
        return sum(float(v) for v in re.findall(r"^pdserve_router_handler_errors_total\{[^}]*\} (\S+)$", text, re.M))
