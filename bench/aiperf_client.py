"""NVIDIA's aiperf (`aiperf profile`, pip package `aiperf`) as a second load generator for
bench/busy_host.py: the command line of one measured run against an OpenAI server, the run itself
(a subprocess in its own process group, as aiperf starts a service process per role), and the
numbers read back from its summary export, `profile_export_aiperf.json`.

aiperf lives in a venv of its own (its dependencies clash with the project's):

    python3.11 -m venv ../aiperf-venv && ../aiperf-venv/bin/pip install aiperf

It needs a tokenizer to build its synthetic prompts and to count tokens; it is given a local HF
folder by its absolute path and run with the Hugging Face hub out of reach (`NO_HUB_ENV`), so
it never downloads.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("bench.aiperf_client")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_AIPERF = REPO.parent / "aiperf-venv" / "bin" / "aiperf"
EXPORT_NAME = "profile_export_aiperf.json"  # aiperf's summary when --profile-export-prefix is unset
# NOTE: not HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: with either set, aiperf 0.13 looks every tokenizer
# name up as a hub cache entry (snapshot_download(local_files_only=True)), which refuses a folder
# path. An absolute folder path alone never reaches the hub (aiperf's resolve_alias skips it and
# transformers reads the folder); the closed local endpoint makes any other hub call fail at once
# instead of downloading.
NO_HUB_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
_SECONDS_PER_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "sec": 1.0, "s": 1.0}  # aiperf's time unit tags


@dataclass(frozen=True)
class AiperfRun:
    """One measured aiperf run: streaming chat requests at a fixed concurrency, fixed lengths."""
    binary: Path
    url: str  # the server's root, e.g. http://127.0.0.1:8000
    model: str  # the id the server's GET /v1/models lists
    tokenizer: Path  # a local HF folder with tokenizer.json
    artifact_dir: Path
    num_requests: int
    concurrency: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_warmup: int = 0  # aiperf's own warm-up requests, left out of its profiling metrics
    seed: int = 0
    num_workers: int = 1

    def __post_init__(self):
        assert self.num_requests >= 1 and self.concurrency >= 1 and self.num_warmup >= 0
        assert self.num_prompt_tokens >= 1 and self.num_output_tokens >= 2 and self.num_workers >= 1


def aiperf_command(run: AiperfRun) -> list[str]:
    """`aiperf profile` argv for `run`: greedy (temperature 0) and `ignore_eos`, so every request
    generates exactly num_output_tokens; token counts from the server's usage chunk, as our own
    client counts them; no UI, no GPU or Prometheus scraping (nothing to scrape on a CPU host)."""
    argv = [str(run.binary), "profile", "--model", run.model, "--url", run.url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(run.tokenizer.resolve()), "--concurrency", str(run.concurrency),
            "--request-count", str(run.num_requests),
            "--synthetic-input-tokens-mean", str(run.num_prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(run.num_output_tokens), "--output-tokens-stddev", "0",
            # one dataset entry per request: a repeated prompt would hit the server's prefix cache
            "--num-dataset-entries", str(run.num_requests + run.num_warmup),
            "--extra-inputs", json.dumps({"ignore_eos": True, "temperature": 0.0}),
            "--use-server-token-count", "--random-seed", str(run.seed),
            "--artifact-dir", str(run.artifact_dir), "--ui-type", "none",
            "--no-server-metrics", "--no-gpu-telemetry",
            # aiperf's workers are asyncio: one holds all in-flight requests, and every extra
            # process is one more CPU-burning neighbour on a small host
            "--workers-max", str(run.num_workers), "--record-processors", "1"]
    if run.num_warmup:
        argv += ["--warmup-request-count", str(run.num_warmup)]
    return argv


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Ends aiperf's process group. A running aiperf gets SIGINT first: its services ignore SIGINT
    and SIGTERM and are stopped by the main process. Then SIGKILL to whatever is left, at once when
    aiperf had already exited (a leftover is an orphan)."""
    steps = ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)) if proc.poll() is None else ((signal.SIGKILL, 5.0),)
    for sig, wait_s in steps:
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(ProcessLookupError):  # raised once no process of the group is left
            os.killpg(proc.pid, sig)
            while time.monotonic() < deadline:
                proc.poll()  # reap the leader: a zombie would keep the group alive
                os.killpg(proc.pid, 0)
                time.sleep(0.2)


def run_aiperf(run: AiperfRun, log_path: Path, timeout_s: float) -> dict:
    """Runs `run` to the end and returns `parse_export` of its summary.

    Raises:
        RuntimeError: aiperf exited non-zero, ran past timeout_s, or wrote no summary.
    """
    run.artifact_dir.mkdir(parents=True, exist_ok=True)
    argv = aiperf_command(run)
    logger.info("aiperf: %s (log %s)", " ".join(argv), log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **NO_HUB_ENV}, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"aiperf ran past {timeout_s:.0f} s (log {log_path})") from None
        finally:
            _stop_group(proc)  # its services too, on every way out (Ctrl-C, SIGTERM, timeout)
    if rc != 0:
        raise RuntimeError(f"aiperf exited with {rc} (log {log_path})")
    exports = sorted(run.artifact_dir.rglob(EXPORT_NAME))
    if not exports:
        raise RuntimeError(f"aiperf wrote no {EXPORT_NAME} under {run.artifact_dir} (log {log_path})")
    return parse_export(json.loads(exports[-1].read_text()))


def _stat(data: dict, tag: str, stat: str) -> float | None:
    metric = data.get(tag) or {}
    return metric.get(stat)


def _seconds(data: dict, tag: str, stat: str = "p50") -> float | None:
    """A time metric's statistic in seconds, from the unit aiperf wrote next to it."""
    value = _stat(data, tag, stat)
    if value is None:
        return None
    return value * _SECONDS_PER_UNIT[data[tag]["unit"]]


def parse_export(data: dict) -> dict:
    """The numbers of one aiperf summary (the JSON of aiperf's `JsonExportData`), in the same keys
    and units as bench.serving_vs_vllm.target_row: output tok/s, p50 latencies in seconds, request
    counts and the errors by message. itl_p50_s is aiperf's inter_token_latency (each request's
    decode time over its tokens after the first, so ours' tbt_p50_s is its peer); inter_chunk_p50_s
    is aiperf's gaps between streamed chunks (ours' itl_p50_s is that)."""
    errors: dict[str, int] = {}
    for entry in data.get("error_summary") or []:
        details = entry["error_details"]
        key = details.get("message") or details.get("type") or "unknown"
        errors[key] = errors.get(key, 0) + entry["count"]
    duration = _stat(data, "benchmark_duration", "avg")
    unit = (data.get("benchmark_duration") or {}).get("unit", "sec")
    return {"output_tok_s": _stat(data, "output_token_throughput", "avg"),
            "ttft_p50_s": _seconds(data, "time_to_first_token"),
            "itl_p50_s": _seconds(data, "inter_token_latency"),
            "inter_chunk_p50_s": _seconds(data, "inter_chunk_latency"),
            "e2e_p50_s": _seconds(data, "request_latency"),
            "num_ok": int(_stat(data, "request_count", "avg") or 0),
            "num_failed": int(_stat(data, "error_request_count", "avg") or 0),
            "errors": errors,
            "duration_s": None if duration is None else duration * _SECONDS_PER_UNIT[unit],
            "num_output_tokens": _stat(data, "total_output_tokens", "avg"),
            # the server's count (usage), chat template included: more than the synthetic text's
            "prompt_tokens_p50": _stat(data, "input_sequence_length", "p50"),
            "is_complete": data.get("is_complete"), "aiperf_version": data.get("aiperf_version")}
