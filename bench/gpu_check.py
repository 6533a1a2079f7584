"""One prepared check for a machine with a CUDA GPU: a probe, then sections (bench/gpu_sections.py,
bench/gpu_flex.py, bench/gpu_spec.py, bench/gpu_memory.py, bench/gpu_pd.py, bench/gpu_nixl.py, bench/gpu_two.py), each in a process of its own
(forked from a fork server that imported torch and the engine once) under a time limit of its own,
the whole run under RUN_S (7.5 minutes); writes the JSON gathered so far to OUT/gpu_check.json as
each section ends (a device call is often all a session gets). Prints the whole JSON object on
stdout at the end; logs go to stderr.

    python -m bench.gpu_check                        # on the GPU machine (OUT: $OUT, else bench/results)
    python -m bench.gpu_check --sections engine decode --out /tmp/x   # and the probe, which they need
    python -m bench.gpu_check --dry-run              # every section's control flow on CPU stand-ins

A section runs only if what it needs ran and holds (`Section.needs`): a failed CUDA IPC probe skips
the sections that share memory between processes (pd_one_gpu, ipc_copy), not the engine's; one
device skips two_gpu. A skipped section's entry says why ({"skipped": ...}).

--dry-run stand-ins: the CPU for the GPU, a 2-layer tiny Llama for the ~8B shape, shared memory
for CUDA IPC, two CPU processes over gloo for two GPUs over NCCL, batches of 1 and 4 with 8 output
tokens; CI runs it and checks the JSON's keys.
Without a CUDA device and without --dry-run it prints {"cuda": false, ...} and exits 0.
Exit status 1: some section failed or ran out of time (its entry holds the error).
Not built yet, so not checked: the JSON's not_built names them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from bench import gpu_flex, gpu_memory, gpu_nixl, gpu_pd, gpu_sections, gpu_spec, gpu_two
from bench.gpu_sections import Plan

logger = logging.getLogger("bench.gpu_check")
RUN_S = 450.0  # the whole run's limit (a device call gets 10 minutes; the machine's start takes some)
MIN_START_S = 15.0  # a section is not started with less of the run's time left than this


@dataclass(frozen=True)
class Section:
    fn: Callable[[Plan], dict]
    limit_s: float  # its own time limit, within the run's
    needs: tuple[str, ...] = ()  # "section" (ran without error) or "section.key" (and key is true)


# run in this order; the limits add up to RUN_S
SECTIONS = {"probe": Section(gpu_sections.probe, 32),
            "engine": Section(gpu_sections.engine_vs_transformers, 50, ("probe",)),
            "decode": Section(gpu_sections.decode, 70, ("probe",)),
            "flex": Section(gpu_flex.flex, gpu_flex.LIMIT_S, ("probe",)),
            "speculative": Section(gpu_spec.speculative, gpu_spec.LIMIT_S, ("probe",)),
            "memory": Section(gpu_memory.memory, 35, ("probe",)),
            "pd_one_gpu": Section(gpu_pd.pd_one_gpu, 70, ("probe.ipc_ok",)),
            "ipc_copy": Section(gpu_sections.ipc_copy, 15, ("probe.ipc_ok",)),
            "nixl": Section(gpu_nixl.nixl, gpu_nixl.LIMIT_S, ("probe",)),
            "two_gpu": Section(gpu_two.two_gpu, 38, ("probe.two_devices",))}
NOT_BUILT: list[str] = []  # checks the issue asks for that no section makes yet
# imported once, by the fork server each section's process is forked from (a fresh process each, as
# with spawn, without importing these again: ~3 s a section); none of them initializes CUDA
PRELOAD = ["torch", "transformers", "bench.gpu_check", "engine.runner.model_runner", "decode_worker.engine"]


def unmet(section: Section, results: dict[str, dict]) -> str | None:
    """Why `section` cannot run given the results so far (None: it can)."""
    for need in section.needs:
        name, _, key = need.partition(".")
        got = results.get(name)
        if got is None or "skipped" in got:
            return f"needs {name}, which did not run"
        if "error" in got:
            return f"needs {name}, which failed"
        if key and not got.get(key):
            return f"needs {need}, which is {got.get(key)!r}"
    return None


def run_all(names: list[str], plan: Plan, time_scale: float, run=None, on_result=None,
            clock=time.monotonic) -> dict[str, dict]:
    """Runs the named sections in SECTIONS' order within RUN_S * time_scale: one whose needs are
    unmet, or that would start with under MIN_START_S left, is recorded as skipped with why;
    a failure skips only what needs it. `run(name, plan, limit_s)`: run_section; it and `clock`
    are stand-ins in tests."""
    run = run or run_section
    names = set(names) | {need.partition(".")[0] for n in names for need in SECTIONS[n].needs}
    results: dict[str, dict] = {}
    deadline = clock() + RUN_S * time_scale
    for name in [n for n in SECTIONS if n in names]:
        section, left = SECTIONS[name], deadline - clock()
        if (why := unmet(section, results)) is None and left < MIN_START_S * time_scale:
            why = f"the run's {RUN_S * time_scale:.0f} s are spent"
        if why is not None:
            logger.warning("section %s skipped: %s", name, why)
            results[name] = {"skipped": why}
        else:
            results[name] = run(name, plan, min(section.limit_s * time_scale, left))
        if on_result is not None:
            on_result(results)
    return results


def _section_main(name: str, plan: Plan, conn) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s [{name}] %(name)s: %(message)s")
    sys.stdout = sys.stderr  # stdout carries the JSON object only
    try:
        result = SECTIONS[name].fn(plan)
    except Exception as exc:  # noqa: BLE001 -- reported in the JSON; the other sections go on
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    conn.send(result)


def run_section(name: str, plan: Plan, limit_s: float) -> dict:
    """Runs one section in a process of its own, forked from the fork server (PRELOAD); its dict, or
    an error past `limit_s`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_section_main, args=(name, plan, send), name=f"gpu-check-{name}")
    start = time.monotonic()
    proc.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(limit_s) else {"error": f"no result within {limit_s:.0f} s"}
    except EOFError:
        result = {"error": f"the section's process died (exit code {proc.exitcode})"}
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    result["seconds"] = round(time.monotonic() - start, 1)
    logger.info("section %s: %s", name, json.dumps(result)[:2000])
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--dry-run", action="store_true", help="run on the CPU stand-ins named above")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--out", default=None, help="folder for gpu_check.json (default: $OUT, else bench/results)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every section's time limit, and the run's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if not args.dry_run and not torch.cuda.is_available():
        logger.warning("no CUDA device and no --dry-run: nothing to check")
        print(json.dumps({"cuda": False, "torch_version": torch.__version__, "torch_cuda": torch.version.cuda,
                          "reason": "torch.cuda.is_available() is False"}))
        return 0
    plan = Plan.dry_run() if args.dry_run else Plan()
    out_dir = Path(args.out or os.environ.get("OUT") or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"dry_run": args.dry_run, "stand_ins": list(plan.stand_ins), "not_built": NOT_BUILT,
              "sections": {}}

    def write(sections: dict) -> None:  # as each section ends: a device call is often all a session gets
        result["sections"] = sections
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))

    run_all(args.sections, plan, args.time_scale, on_result=write)
    print(json.dumps(result))
    return 1 if any("error" in r for r in result["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
