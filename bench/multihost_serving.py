"""Across hosts of the test bed (bench/multihost.py) against the same on one host, in the same run.

    python -m bench.multihost_serving                      # both parts
    python -m bench.multihost_serving --part kv --json
    python -m bench.multihost_serving --part ttst --prompt-len 1024 --reps 5

kv: KV bytes/s of pdserve's transport (and of raw gloo, the yardstick) between two processes on
one host (loopback) and between two hosts over the bridge: `bench.kv_transfer` with its receiver
in the same host, then in the other; the two alternate `--alternations` times.

ttst: time to the second token of `--prompt-len`-token prompts through `pdserve serve` (HTTP,
streamed, one request at a time). The first token streams from the prefill instance while the KV
is still moving; the second needs every layer on the decode instance, so the transfer shows
there. One bed has a single worker host carrying both role resources (P and D on one host), the
other a prefill host and a decode host. Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import subprocess
import sys
import time

import httpx

from bench.multihost import BIN, Bed, HostSpec
from bench.offline import random_prompts

logger = logging.getLogger("bench.multihost_serving")


def serve_on_bed(bed: Bed, *extra_args: str, port: int = 8000, timeout: float = 300.0):
    """Runs `pdserve serve` on the bed's gateway host against its Ray cluster and redis.

    Returns:
        (base url "http://GW_IP:port", the process) once `GET /ready` answers 200. Raises
        RuntimeError with the tail of its log if the process exits or `timeout` passes first.
    """
    gw = bed.address("gw")
    log = bed.dir / f"serve-{port}-{time.monotonic_ns()}.log"
    # NOTE: a cluster name (Ray namespace) of its own unless given: the instances a killed server
    # left are never adopted by the next one
    name = [] if "--cluster-name" in extra_args else ["--cluster-name", f"serve-{time.monotonic_ns()}"]
    argv = [str(BIN / "pdserve"), "serve", "--ray-address", bed.ray_address, "--redis-url", bed.redis_url,
            "--ray-resources", *name, "--host", gw, "--port", str(port), *extra_args]
    proc = bed.popen("gw", argv, log=log)
    url, deadline = f"http://{gw}:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited ({proc.returncode}):\n{bed.log_tail('gw', path=log)}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise RuntimeError(f"pdserve serve not ready within {timeout} s:\n{bed.log_tail('gw', path=log)}")


def stop_process(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kv_run(bed: Bed, args, receiver: str | None) -> dict:
    """One `bench.kv_transfer` run with its sender in host a; receiver in host a, or in `receiver`."""
    argv = [sys.executable, "-m", "bench.kv_transfer", "--json", "--tokens", *map(str, args.tokens),
            "--reps", str(args.kv_reps), "--rounds", "1"]
    if receiver is not None:
        argv += ["--receiver-netns", bed.hosts[receiver].link.netns, "--sender-host", bed.address("a"),
                 "--receiver-host", bed.address(receiver)]
    out = bed.run("a", argv, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"bench.kv_transfer failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_kv(args) -> dict:
    hosts = [HostSpec("head", "head"), HostSpec("a", "worker"), HostSpec("b", "worker")]
    runs: dict[str, list[dict]] = {"one_host": [], "two_hosts": []}
    with Bed(hosts) as bed:
        for i in range(args.alternations):  # alternate: drift on a shared machine hits both
            runs["one_host"].append(_kv_run(bed, args, None))
            runs["two_hosts"].append(_kv_run(bed, args, "b"))
            logger.info("kv alternation %d/%d done", i + 1, args.alternations)
    rows = []
    for k, tokens in enumerate(args.tokens):
        med = {where: {key: statistics.median(r["rows"][k][key] for r in rs)
                       for key in ("pdserve_GBps", "raw_gloo_per_layer_GBps", "pdserve_ms_per_request")}
               for where, rs in runs.items()}
        rows.append({"tokens": tokens, **{f"{where}_{key}": v for where, m in med.items() for key, v in m.items()},
                     "two_hosts_vs_one_pdserve": med["two_hosts"]["pdserve_GBps"] / med["one_host"]["pdserve_GBps"]})
    return {"alternations": args.alternations, "reps": args.kv_reps, "rows": rows}


def _stream_two_tokens(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, first -> second token) of one streamed completion with max_tokens=2."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    start, times = time.monotonic(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                times += [time.monotonic()] * len(lp.get("tokens") or [])
    if len(times) != 2:
        raise RuntimeError(f"expected 2 tokens, got {len(times)}")
    return times[0] - start, times[1] - times[0]


def _ttst_bed(args, hosts: list[HostSpec]) -> dict:
    with Bed(hosts) as bed:
        url, proc = serve_on_bed(bed, "--dtype", args.dtype, "--num-threads", "1", "--max-num-batched-tokens",
                                str(max(2048, args.prompt_len)), "--num-kv-blocks", "512")
        try:
            placed = {i["role"]: sorted({r["node_ip"] for r in i["ranks"]})
                      for i in httpx.get(f"{url}/status", timeout=10).json()["instances"]}
            prompts = random_prompts(args.reps + 1, args.prompt_len, seed=7)  # no prefix hits
            _stream_two_tokens(url, prompts[0])  # warm-up: the pair group, first-call costs
            samples = [_stream_two_tokens(url, p) for p in prompts[1:]]
        finally:
            stop_process(proc)
    return {"placement": placed, "ttft_median_s": statistics.median(s[0] for s in samples),
            "second_token_median_s": statistics.median(s[1] for s in samples),
            "second_token_s": [s[1] for s in samples]}


def bench_ttst(args) -> dict:
    base = [HostSpec("head", "head"), HostSpec("gw", "gateway"), HostSpec("redis", "redis")]
    one = _ttst_bed(args, base + [HostSpec("pd", "worker", num_cpus=2, resources={"prefill": 1, "decode": 1})])
    logger.info("one host: %s", one)
    two = _ttst_bed(args, base + [HostSpec("p", "prefill", num_cpus=1, resources={"prefill": 1}),
                                  HostSpec("d", "decode", num_cpus=1, resources={"decode": 1})])
    logger.info("two hosts: %s", two)
    return {"prompt_len": args.prompt_len, "reps": args.reps, "dtype": args.dtype, "one_host": one, "two_hosts": two,
            "two_hosts_vs_one_second_token": two["second_token_median_s"] / one["second_token_median_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multihost_serving", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--part", choices=["kv", "ttst", "all"], default="all")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="kv: tokens per request")
    p.add_argument("--kv-reps", type=int, default=5, help="kv: requests per timed batch")
    p.add_argument("--alternations", type=int, default=3, help="kv: one-host/two-host run pairs")
    p.add_argument("--prompt-len", type=int, default=1024, help="ttst: prompt tokens")
    p.add_argument("--reps", type=int, default=5, help="ttst: timed requests per placement")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = {}
    if args.part in ("kv", "all"):
        out["kv"] = bench_kv(args)
    if args.part in ("ttst", "all"):
        out["ttst"] = bench_ttst(args)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
