"""The control plane at 10, 100 and 1,000 instances: the real router, controller, gateways and a real
Redis against simulated instances (bench/sim_instances.py: many per Ray actor, answering the instance
interface with a measured profile's times). One JSON object, a row per (instances, gateways):

    python -m bench.control_plane --instances 10,100,1000 --gateways 1,2,4 --json

Per row (bench/control_plane_bed.py builds the bed, all on loopback):
  controller_start_s       the controller creating and registering every instance
  gateways_ready_s         the gateway processes starting until each has attached every instance
  probe_cycle_s_p50/p99    one controller probe of every instance (load + heartbeat into Redis)
  redis_ops_per_s_idle     Redis commands per second with no requests (probes, gateway syncs, stats)
  gateway_cpu_idle         the first gateway's CPU with no requests, in cores (its collectors, syncs)
  controller_cpu_idle      the controller's CPU meanwhile, in cores (its probes)
  router_decision_ms_p50/p99  the router's placement decision (the policy's picks, under its lock)
  gateway_rps              completed requests per second through one gateway, `--concurrency` in flight
  redis_ops_per_s_load     Redis commands per second meanwhile
  gateway_cpu_ms_per_request  the gateway's CPU per request beyond its idle CPU (HTTP, router)
  new_instance_visible_s   an instance added until every gateway has attached it
  dead_instance_visible_s  an instance that stops answering until every gateway has dropped it
  dead_instance_replaced_s ... until the controller's replacement is attached by every gateway
  planner_converged_s      the real autoscaler over the bed (SLO planner, every second): after the decode
                           instances report a tenth more sequences than the TBT target holds, seconds
                           until that many more serve (`--cold-start` each)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from bench.control_plane_bed import Bed
from cluster.autoscale.autoscaler import Profile

PROFILE = Path(__file__).resolve().parent / "profiles" / "smollm2-cpu.json"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _load(port: int, concurrency: int, seconds: float, prompt_tokens: int, max_tokens: int) -> dict:
    """Closed loop: `concurrency` clients, each sending its next request when the last completed."""
    body = {"model": "smollm2", "prompt": list(range(100, 100 + prompt_tokens)), "max_tokens": max_tokens}
    done, errors, latencies = 0, 0, []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
        async def one_client():
            nonlocal done, errors
            while time.monotonic() < deadline:
                start = time.monotonic()
                try:
                    r = await client.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    done += 1
                    latencies.append(time.monotonic() - start)
                else:
                    errors += 1

        start = time.monotonic()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        took = time.monotonic() - start
    return {"rps": done / took, "completed": done, "errors": errors,
            "latency_s_p50": pct(latencies, 0.5), "latency_s_p99": pct(latencies, 0.99)}


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _window(bed: Bed, seconds: float) -> tuple[float, float, float]:
    """Redis commands per second, the first gateway's CPU and the controller's (this process, idle
    but for it), in cores, over `seconds`."""
    before, start = bed.redis_commands(), time.monotonic()
    cpu, own = cpu_s(bed.gateways[0].pid), cpu_s(os.getpid())
    time.sleep(seconds)
    took = time.monotonic() - start
    return ((bed.redis_commands() - before) / took, (cpu_s(bed.gateways[0].pid) - cpu) / took,
            (cpu_s(os.getpid()) - own) / took)


def measure(instances: int, gateways: int, args, profile: Profile) -> dict:
    bed = Bed(instances, gateways, profile, heartbeat_ttl_s=args.heartbeat_ttl)
    try:
        row = {"instances": instances, "gateways": gateways, "hosts": bed.num_hosts,
               "controller_start_s": round(bed.controller_start_s, 3),
               "gateways_ready_s": round(bed.gateways_ready_s, 3)}
        bed.controller.probe_s.clear()
        redis_ops, cores, controller = _window(bed, args.idle_s)
        row.update(redis_ops_per_s_idle=round(redis_ops), gateway_cpu_idle=round(cores, 3),
                   controller_cpu_idle=round(controller, 3))
        probes = list(bed.controller.probe_s)
        row["probe_cycle_s_p50"], row["probe_cycle_s_p99"] = pct(probes, 0.5), pct(probes, 0.99)
        bed.stats(bed.ports[0])  # (empties its decision times)
        before, cpu = bed.redis_commands(), cpu_s(bed.gateways[0].pid)
        load = asyncio.run(_load(bed.ports[0], args.concurrency, args.load_s, args.prompt_tokens, args.max_tokens))
        row["redis_ops_per_s_load"] = round((bed.redis_commands() - before) / args.load_s)
        busy = cpu_s(bed.gateways[0].pid) - cpu - row["gateway_cpu_idle"] * args.load_s
        row["gateway_cpu_ms_per_request"] = round(1000 * busy / max(load["completed"], 1), 2)
        decisions = (bed.stats(bed.ports[0]) or {}).get("plan_s", [])
        row["router_decision_ms_p50"] = None if not decisions else 1000 * pct(decisions, 0.5)
        row["router_decision_ms_p99"] = None if not decisions else 1000 * pct(decisions, 0.99)
        row.update(gateway_rps=round(load["rps"], 1), requests_completed=load["completed"],
                   request_errors=load["errors"], latency_s_p50=load["latency_s_p50"],
                   latency_s_p99=load["latency_s_p99"])
        row["new_instance_visible_s"] = _new_visible(bed)
        row["dead_instance_visible_s"], row["dead_instance_replaced_s"] = _dead_visible(bed)
        row.update(_planner_step(bed, args.cold_start))
        return row
    finally:
        bed.close()


def _new_visible(bed: Bed) -> float:
    start = time.monotonic()
    iid = bed.controller.add_instance("decode")
    bed.wait(lambda stats: iid in stats["instances"], 120, f"every gateway attaches {iid}")
    return round(time.monotonic() - start, 3)


def _dead_visible(bed: Bed) -> tuple[float, float]:
    """Seconds until every gateway has dropped an instance gone silent (its calls' deadlines or the
    controller's verdict, whichever first), and until the controller's replacement is attached by all."""
    ctl = bed.controller
    before = set(ctl.instances)
    iid = sorted(i for i in before if i.startswith("decode"))[0]
    start = time.monotonic()
    ctl.kill_instance(iid)
    bed.wait(lambda stats: not stats["instances"].get(iid, False), 120, f"every gateway drops {iid}")
    dropped = time.monotonic() - start
    deadline = start + 120
    while iid in ctl.instances or len(ctl.instances) < len(before):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not replace {iid} in 120 s")
        time.sleep(0.05)
    new = (set(ctl.instances) - before).pop()
    bed.wait(lambda stats: stats["instances"].get(new, False), 120, f"every gateway attaches {new}")
    return round(dropped, 3), round(time.monotonic() - start, 3)


FIGURES = {"router_decision_ms_p50": "router decision p50 (ms)", "router_decision_ms_p99": "router decision p99 (ms)",
           "gateway_rps": "requests/s through one gateway", "redis_ops_per_s_idle": "Redis commands/s, no requests",
           "redis_ops_per_s_load": "Redis commands/s under load", "probe_cycle_s_p50": "controller probe cycle (s)",
           "new_instance_visible_s": "a new instance seen by every gateway (s)",
           "dead_instance_visible_s": "a dead instance dropped by every gateway (s)",
           "dead_instance_replaced_s": "a dead instance's replacement attached by every gateway (s)",
           "gateways_ready_s": "gateways started, every instance attached (s)",
           "gateway_cpu_idle": "a gateway's CPU with no requests (cores)",
           "gateway_cpu_ms_per_request": "a gateway's CPU per request (ms)",
           "controller_cpu_idle": "the controller's CPU, no requests (cores)",
           "planner_converged_s": "planner: a tenth more decode instances serving (s)"}


def plot(rows: list[dict], folder: Path) -> None:
    """One PNG per figure: the value against instances (log scale), a line per gateway count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    for key, title in FIGURES.items():
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        for g in sorted({r["gateways"] for r in rows}):
            points = [(r["instances"], r[key]) for r in rows if r["gateways"] == g and r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{g} gateway{'s' if g > 1 else ''}")
        ax.set_xscale("log")
        ax.set_xlabel("instances")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / f"{key}.png", dpi=90)
        plt.close(fig)


def _planner_step(bed: Bed, cold_start_s: float) -> dict:
    """The real autoscaler (SLO planner, RayActuator) over the bed, deciding every second: the decode
    instances report a tenth more sequences than they hold at the TBT target (a load step); seconds
    until the decode pool serves at its new size, each new instance after `cold_start_s`."""
    import ray
    from cluster.autoscale.autoscale_loop import create_autoscaler
    ctl, profile = bed.controller, bed.profile
    decode = sorted(i for i, inst in ctl.instances.items() if inst.role == "decode" and inst.client.info.healthy)
    step, tbt = max(1, len(decode) // 10), 0.3
    path = Path(bed.workdir) / "profile.json"
    profile.save(path)
    prefill = len(ctl.instances) - len(decode)
    spec = replace(bed.spec, autoscale=True, autoscale_profile=str(path), autoscale_interval_s=1.0, tbt_slo_s=tbt,
                   ttft_slo_s=600.0, min_prefill=prefill, max_prefill=prefill, min_decode=1,
                   max_decode=len(decode) + step, scale_up_cooldown_s=0.0, scale_down_cooldown_s=3600.0)
    ctl.startup_s = cold_start_s
    scaler = create_autoscaler(ctl, spec).start()
    try:
        time.sleep(2.5)  # (a few decisions at rest: nothing changes)
        total = (len(decode) + step - 0.5) * profile.max_batch(tbt) / (1 + spec.scale_headroom)
        each = {iid: total / len(decode) for iid in decode}
        start = time.monotonic()
        ray.get([h.set_background.remote(each) for h in bed.hosts])
        while scaler.actuator.current().decode < len(decode) + step:
            if time.monotonic() - start > 300:
                raise TimeoutError("the planner did not reach its target in 300 s")
            time.sleep(0.1)
        converged = time.monotonic() - start
        time.sleep(2.5)  # (and stays there)
        return {"planner_decode_before": len(decode), "planner_step_instances": step,
                "planner_converged_s": round(converged, 3),
                "planner_decode_after": scaler.actuator.current().decode, "planner_errors": scaler.errors}
    finally:
        scaler.close()
        ctl.startup_s = 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="10,100,1000", help="comma-separated instance counts")
    ap.add_argument("--gateways", default="1,2,4", help="comma-separated gateway counts")
    ap.add_argument("--profile", default=str(PROFILE), help="the instances' times (`pdserve bench --profile`)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight on the gateway measured")
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--heartbeat-ttl", type=float, default=5.0)
    ap.add_argument("--cold-start", type=float, default=6.5,
                    help="seconds a simulated instance takes to start (6.5: SmolLM2 added to a running cluster "
                         "here, bench/results/flip_2026-12-07.json)")
    ap.add_argument("--speedup", type=float, default=1.0,
                    help="instances this many times faster than the profile (1: as measured; more: the gateway "
                         "rather than the instances limits the requests per second)")
    ap.add_argument("--json", action="store_true", help="print the JSON object (else a table)")
    ap.add_argument("--plot", help="a folder: one PNG per figure, against instances, a line per gateway count")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    p = Profile.load(args.profile)
    profile = replace(p, prefill_tokens_per_s=p.prefill_tokens_per_s * args.speedup,
                      decode_itl_base_s=p.decode_itl_base_s / args.speedup,
                      decode_itl_per_seq_s=p.decode_itl_per_seq_s / args.speedup)
    rows = []
    for n in (int(x) for x in args.instances.split(",")):
        for g in (int(x) for x in args.gateways.split(",")):
            rows.append(measure(n, g, args, profile))
            print(json.dumps(rows[-1]), file=sys.stderr)
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        keys = [k for k in rows[0] if k not in ("hosts",)]
        print("  ".join(keys))
        for row in rows:
            print("  ".join(str(row[k]) for k in keys))


if __name__ == "__main__":
    main()
