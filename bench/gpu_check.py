"""One prepared check for a machine with a CUDA GPU: probes first, then runs its sections
(bench/gpu_sections.py), each in a process of its own under a time limit of its own, and writes
the JSON gathered so far to OUT/gpu_check.json as each section ends (a device call is often all a
session gets). Prints the whole JSON object on stdout at the end; logs go to stderr.

    python -m bench.gpu_check                        # on the GPU machine (OUT: $OUT, else bench/results)
    python -m bench.gpu_check --sections probe engine --out /tmp/x
    python -m bench.gpu_check --dry-run              # every section's control flow on CPU stand-ins

--dry-run stand-ins: the CPU for the GPU, a 2-layer tiny Llama for the ~8B shape, shared memory
for CUDA IPC, batches of 1 and 4 with 8 output tokens; CI runs it and checks the JSON's keys.
Without a CUDA device and without --dry-run it prints {"cuda": false, ...} and exits 0.
Exit status 1: some section failed or ran out of time (its entry holds the error).
pd_one_gpu (bench/gpu_pd.py): 1P1D on the one GPU, the KV over CUDA IPC, equal to colocated.
Not built yet, so not checked: none (the JSON's not_built would name them).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench import gpu_pd, gpu_sections
from bench.gpu_sections import Plan

logger = logging.getLogger("bench.gpu_check")
# name -> (function, default time limit in seconds); the limits add up to 7 minutes
SECTIONS = {"probe": (gpu_sections.probe, 60), "engine": (gpu_sections.engine_vs_transformers, 90),
            "decode": (gpu_sections.decode, 160), "ipc_copy": (gpu_sections.ipc_copy, 60),
            "pd_one_gpu": (gpu_pd.pd_one_gpu, 50)}
NOT_BUILT: list[str] = []  # checks the issue asks for that no section makes yet


def _section_main(name: str, plan: Plan, conn) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s [{name}] %(name)s: %(message)s")
    sys.stdout = sys.stderr  # stdout carries the JSON object only
    try:
        result = SECTIONS[name][0](plan)
    except Exception as exc:  # noqa: BLE001 -- reported in the JSON; the other sections go on
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    conn.send(result)


def run_section(name: str, plan: Plan, limit_s: float) -> dict:
    """Runs one section in a spawned process; its dict, or an error past `limit_s`."""
    ctx = mp.get_context("spawn")
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
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every section's time limit")
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
    if "probe" in args.sections and "probe" != args.sections[0]:
        args.sections = ["probe"] + [s for s in args.sections if s != "probe"]  # the probe goes first
    for name in args.sections:
        result["sections"][name] = run_section(name, plan, SECTIONS[name][1] * args.time_scale)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))
        if name == "probe" and "error" in result["sections"]["probe"]:
            logger.error("the probe failed: the other sections would too; stopping")
            break
    print(json.dumps(result))
    return 1 if any("error" in r for r in result["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
