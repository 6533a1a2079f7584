"""bench/busy_host.py and bench/aiperf_client.py without servers or a model: the flags, the busy
neighbours' lifecycle, the ratios, aiperf's command line and summary, and the plot."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bench import aiperf_client, busy_host


def last_error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def create_row(tok_s: float | None, itl_s: float | None = 0.05) -> dict:
    return {"output_tok_s": tok_s, "ttft_p50_s": 0.2, "itl_p50_s": itl_s, "num_ok": 4, "num_failed": 0}


# -- flags ------------------------------------------------------------------------------------------

def test_defaults_and_order(tmp_path):
    """By default: the three servers, 0/1/2 neighbours, bfloat16, 64 requests at 8 in flight with
    4 settle requests; lists keep their order and run a repeat once."""
    (tmp_path / "python").touch()
    (tmp_path / "config.json").touch()
    args = busy_host.parse_args(["--clients", "ours", "--vllm-python", str(tmp_path / "python"),
                                 "--vllm-model", str(tmp_path)])
    assert (args.targets, args.clients) == (("colocated", "disaggregated", "vllm"), ("ours",))
    assert (args.neighbours, args.dtype) == ((0, 1, 2), "bfloat16")
    args = busy_host.parse_args(["--targets", "disaggregated,colocated,disaggregated", "--neighbours", "2, 0,2",
                                 "--clients", "ours"])
    assert (args.targets, args.neighbours, args.clients) == (("disaggregated", "colocated"), (2, 0), ("ours",))
    assert args.workload.num_requests == 64 and args.workload.concurrency == 8 and args.settle == 4


COUNTS = "(whole numbers from 0 to 64)"


@pytest.mark.parametrize("flags, message", [
    (["--neighbours", "-1"], f"argument --neighbours: unknown neighbour count '-1' in '-1' {COUNTS}"),
    (["--neighbours", "0,1.5"], f"argument --neighbours: unknown neighbour count '1.5' in '0,1.5' {COUNTS}"),
    (["--neighbours", "65"], f"argument --neighbours: unknown neighbour count '65' in '65' {COUNTS}"),
    (["--clients", "ours,genai-perf"], "argument --clients: unknown client 'genai-perf' (choose from ours, aiperf)"),
    (["--targets", "offline"], "argument --targets: unknown target 'offline' (choose from colocated, "
                               "disaggregated, vllm)"),
])
def test_bad_lists_are_one_line_errors(flags, message, capsys):
    """A neighbour count that is not a whole number in 0..64, or an unknown client or target, stops
    argparse with one line naming it."""
    with pytest.raises(SystemExit) as exc:
        busy_host.parse_args(["--targets", "colocated", *flags])
    assert exc.value.code == 2
    assert last_error_line(capsys) == f"python -m bench.busy_host: error: {message}"


def test_missing_paths_are_refused_only_when_needed(tmp_path, capsys):
    """A missing aiperf binary is an error when the aiperf client is asked, and not otherwise; a
    missing vLLM python or model folder when vllm is a target; a tokenizer folder without
    tokenizer.json when aiperf is."""
    missing = str(tmp_path / "nothing")
    with pytest.raises(SystemExit):
        busy_host.parse_args(["--targets", "colocated", "--clients", "aiperf", "--aiperf", missing])
    assert f"--aiperf {missing} is not an executable" in last_error_line(capsys)
    assert busy_host.parse_args(["--targets", "colocated", "--clients", "ours", "--aiperf", missing]).aiperf == missing
    with pytest.raises(SystemExit):
        busy_host.parse_args(["--targets", "vllm", "--clients", "ours", "--vllm-python", missing])
    assert f"--vllm-python {missing} does not exist" in last_error_line(capsys)
    python = str(tmp_path / "python")
    Path(python).touch()
    with pytest.raises(SystemExit):
        busy_host.parse_args(["--targets", "vllm", "--clients", "ours", "--vllm-python", python,
                              "--vllm-model", missing])
    assert f"--vllm-model {missing} is not a HF model folder" in last_error_line(capsys)
    with pytest.raises(SystemExit):
        busy_host.parse_args(["--targets", "colocated", "--aiperf", "/bin/true", "--aiperf-tokenizer", str(tmp_path)])
    assert f"aiperf's tokenizer folder {tmp_path} has no tokenizer.json" in last_error_line(capsys)


# -- the neighbours ---------------------------------------------------------------------------------

def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"neighbour {pid} is still in /proc"
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_neighbours_burn_cpu_and_are_all_gone_after():
    """N neighbours are N live processes, each the leader of its own process group, each burning
    CPU; after the block none is left (no process, no zombie, no group)."""
    with busy_host.busy_neighbours(2) as procs:
        pids = [p.pid for p in procs]
        assert len(set(pids)) == 2 and all(os.getpgid(pid) == pid for pid in pids)
        assert all(os.getpgid(pid) != os.getpgid(0) for pid in pids)
        time.sleep(0.8)
        assert all(p.poll() is None for p in procs)
        # two busy loops on however few CPUs get at least a fifth of a CPU each in 0.8 s
        assert all(busy_host.cpu_seconds(pid) > 0.15 for pid in pids), [busy_host.cpu_seconds(p) for p in pids]
    _assert_gone(pids)


def test_neighbours_are_killed_when_the_body_raises():
    """An exception in the body (an error, Ctrl-C) still kills and reaps every neighbour, and the
    exception is the one that comes out."""
    pids = []
    with pytest.raises(KeyboardInterrupt):
        with busy_host.busy_neighbours(3) as procs:
            pids = [p.pid for p in procs]
            raise KeyboardInterrupt
    assert len(pids) == 3
    _assert_gone(pids)


def test_zero_neighbours_start_nothing():
    """0 neighbours is the quiet baseline: no process at all."""
    with busy_host.busy_neighbours(0) as procs:
        assert procs == []


def test_a_neighbour_killed_from_outside_is_fine():
    """A neighbour that died early (someone killed it) does not make the exit fail."""
    with busy_host.busy_neighbours(1) as procs:
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
    _assert_gone([procs[0].pid])


# -- the numbers ------------------------------------------------------------------------------------

def test_ratios():
    """kept = tok/s over the same target and client at 0 neighbours; over_vllm = pdserve over vLLM
    at the same count and client. By hand: colocated 100 / 50 / 20 and vLLM 40 / 30 / 20 ->
    kept 1, 0.5, 0.2 and 1, 0.75, 0.5; over vLLM 2.5, 1.667, 1. A failed row (None) and a missing
    or zero reference give no ratio; vLLM gets no over_vllm of its own."""
    results = {"ours": {"colocated": {"0": create_row(100.0), "1": create_row(50.0), "2": create_row(20.0)},
                        "vllm": {"0": create_row(40.0), "1": create_row(30.0), "2": create_row(20.0)}},
               "aiperf": {"colocated": {"0": create_row(0.0), "1": create_row(10.0)},
                          "disaggregated": {"0": create_row(8.0), "1": create_row(None)},
                          "vllm": {"0": create_row(16.0), "1": create_row(0.0)}}}
    r = busy_host.ratios(results)
    assert r["kept"]["ours"] == {"colocated": pytest.approx({"0": 1.0, "1": 0.5, "2": 0.2}),
                                 "vllm": pytest.approx({"0": 1.0, "1": 0.75, "2": 0.5})}
    assert r["over_vllm"]["ours"] == {"colocated": pytest.approx({"0": 2.5, "1": 5 / 3, "2": 1.0})}
    assert r["kept"]["aiperf"] == {"colocated": {}, "disaggregated": {"0": 1.0}, "vllm": {"0": 1.0, "1": 0.0}}
    assert r["over_vllm"]["aiperf"] == {"colocated": {"0": 0.0}, "disaggregated": {"0": 0.5}}
    assert busy_host.ratios({"ours": {"colocated": {"1": create_row(5.0)}}}) == \
        {"kept": {"ours": {"colocated": {}}}, "over_vllm": {}}


def test_table_lists_every_level():
    """The human table has a line per client, target and count, with kept and over-vLLM."""
    results = {"ours": {"colocated": {"0": create_row(100.0), "1": create_row(50.0)},
                        "vllm": {"0": create_row(40.0), "1": create_row(None) | {"error": "RuntimeError: x"}}}}
    r = {"workload": {"num_requests": 4, "num_prompt_tokens": 128, "num_output_tokens": 64, "concurrency": 8,
                      "dtype": "bfloat16"}, "machine": {"cpus_usable": 2, "cpu_model": "cpu"},
         "log_dir": "/tmp/x", "plot": "/tmp/x/busy_host.png", "results": results, **busy_host.ratios(results)}
    lines = busy_host.format_table(r).splitlines()
    assert lines[lines.index("client ours") + 2].split() == ["colocated", "0", "100.0", "200", "50", "4/0", "1.00",
                                                             "2.50"]
    assert lines[lines.index("client ours") + 3].split()[-2:] == ["0.50", "-"]
    assert lines[-1].split()[:3] == ["vllm", "1", "-"] and lines[-1].endswith("RuntimeError: x")


def test_plot_writes_a_png(tmp_path):
    """The plot is a PNG file at the given path (folders made), also with a failed (None) point."""
    results = {"ours": {"colocated": {"0": create_row(100.0), "1": create_row(50.0, 0.09)}},
               "aiperf": {"colocated": {"0": create_row(90.0), "1": create_row(None, None)}}}
    path = tmp_path / "sub" / "busy_host.png"
    busy_host.write_plot({"results": results, "neighbours": [0, 1], "machine": {"cpus_usable": 2}}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# -- aiperf -----------------------------------------------------------------------------------------

# Cut down from a real aiperf 0.13.0 profile_export_aiperf.json (4 streaming chat requests); the
# error entries are in the shape of aiperf's ErrorDetailsCount / JsonMetricResult models.
AIPERF_EXPORT = {
    "schema_version": "1.4", "aiperf_version": "0.13.0",
    "request_latency": {"unit": "ms", "avg": 727.25, "p50": 727.5436405, "p90": 727.717, "count": 4},
    "request_count": {"unit": "requests", "avg": 4.0},
    "time_to_first_token": {"unit": "ms", "avg": 19.712301, "p50": 19.785045, "p99": 20.2944192, "min": 18.978768,
                            "max": 20.300346, "std": 0.5235, "count": 4, "sum": 78.849204},
    "inter_token_latency": {"unit": "ms", "avg": 11.2308306, "p50": 11.2347061, "count": 4},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 347.31846214808894},
    "inter_chunk_latency": {"unit": "ms", "avg": 11.2308306, "p50": 11.0905565, "count": 252},
    "total_output_tokens": {"unit": "tokens", "avg": 256.0},
    "input_sequence_length": {"unit": "tokens", "avg": 158.0, "p50": 158.0, "std": 0.0, "count": 4},
    "benchmark_duration": {"unit": "sec", "avg": 0.731283712},
    "was_cancelled": False, "is_complete": True, "error_summary": [],
}


def test_parse_export():
    """aiperf's summary in target_row's keys: tok/s as written, ms and sec turned into seconds,
    request counts from request_count / error_request_count (absent: no errors)."""
    row = aiperf_client.parse_export(AIPERF_EXPORT)
    assert row["output_tok_s"] == pytest.approx(347.31846214808894)
    assert row["ttft_p50_s"] == pytest.approx(0.019785045) and row["itl_p50_s"] == pytest.approx(0.0112347061)
    assert row["inter_chunk_p50_s"] == pytest.approx(0.0110905565) and row["e2e_p50_s"] == pytest.approx(0.7275436405)
    assert row["duration_s"] == pytest.approx(0.731283712) and row["num_output_tokens"] == 256.0
    assert row["prompt_tokens_p50"] == 158.0
    assert (row["num_ok"], row["num_failed"], row["errors"], row["is_complete"]) == (4, 0, {}, True)


def test_parse_export_with_errors():
    """Failed requests count from error_request_count, errors grouped by message (type when there
    is none); a run where every request failed has no throughput or latencies, not zeros."""
    errors = {"error_request_count": {"unit": "requests", "avg": 3.0},
              "error_summary": [{"error_details": {"code": 500, "type": "Internal Server Error", "message": "boom"},
                                 "count": 2},
                                {"error_details": {"type": "ClientConnectorError", "message": ""}, "count": 1}]}
    row = aiperf_client.parse_export({**AIPERF_EXPORT, **errors})
    assert (row["num_ok"], row["num_failed"]) == (4, 3)
    assert row["errors"] == {"boom": 2, "ClientConnectorError": 1}
    row = aiperf_client.parse_export({"schema_version": "1.4", "is_complete": True, **errors})
    assert (row["output_tok_s"], row["ttft_p50_s"], row["itl_p50_s"], row["num_ok"]) == (None, None, None, 0)


def create_aiperf_run(tmp_path: Path, binary: Path, **knobs) -> aiperf_client.AiperfRun:
    return aiperf_client.AiperfRun(binary, "http://127.0.0.1:1", "smollm2", tmp_path, tmp_path / "art",
                                   **{"num_requests": 64, "concurrency": 8, "num_prompt_tokens": 128,
                                      "num_output_tokens": 64, **knobs})


def test_aiperf_command():
    """Streaming chat at the workload's concurrency, count and fixed lengths (stddev 0), greedy and
    EOS ignored, one dataset entry per request (no prefix-cache hits), the tokenizer by absolute
    path; aiperf's warm-up flag only when asked for."""
    argv = aiperf_client.aiperf_command(create_aiperf_run(Path("rel"), Path("/x/aiperf"), num_warmup=2, seed=7))

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]
    assert argv[:2] == ["/x/aiperf", "profile"] and "--streaming" in argv and value("--endpoint-type") == "chat"
    assert (value("--concurrency"), value("--request-count"), value("--num-dataset-entries")) == ("8", "64", "66")
    assert (value("--synthetic-input-tokens-mean"), value("--synthetic-input-tokens-stddev")) == ("128", "0")
    assert (value("--output-tokens-mean"), value("--output-tokens-stddev")) == ("64", "0")
    assert json.loads(value("--extra-inputs")) == {"ignore_eos": True, "temperature": 0.0}
    assert (value("--model"), value("--random-seed"), value("--warmup-request-count")) == ("smollm2", "7", "2")
    assert value("--tokenizer") == str(Path("rel").resolve())
    no_warmup = aiperf_client.aiperf_command(create_aiperf_run(Path("rel"), Path("/x/aiperf")))
    assert "--warmup-request-count" not in no_warmup


FAKE_AIPERF = """#!/bin/sh
# stands in for aiperf: leaves a child behind in its process group, like aiperf's services
sleep 600 &
echo $! > "{pid_file}"
dir=""
while [ $# -gt 0 ]; do [ "$1" = "--artifact-dir" ] && dir="$2"; shift; done
mkdir -p "$dir/sub" && cat > "$dir/sub/profile_export_aiperf.json" <<'JSON'
{export}
JSON
exit {rc}
"""


@pytest.mark.parametrize("rc", [0, 3])
def test_run_aiperf_reads_the_export_and_leaves_no_process(tmp_path, rc):
    """run_aiperf parses the summary aiperf wrote (found anywhere under the artifact folder) and
    kills whatever aiperf left in its process group; a non-zero exit is a RuntimeError."""
    binary, pid_file = tmp_path / "aiperf", tmp_path / "child.pid"
    binary.write_text(FAKE_AIPERF.format(pid_file=pid_file, export=json.dumps(AIPERF_EXPORT), rc=rc))
    binary.chmod(0o755)
    run = create_aiperf_run(tmp_path, binary)
    if rc:
        with pytest.raises(RuntimeError, match="aiperf exited with 3"):
            aiperf_client.run_aiperf(run, tmp_path / "aiperf.log", timeout_s=30)
    else:
        assert aiperf_client.run_aiperf(run, tmp_path / "aiperf.log", timeout_s=30)["num_ok"] == 4
    assert process_state(int(pid_file.read_text())) in (None, "Z", "X")  # gone, or dead and not yet reaped


def process_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat (R running, S sleeping, Z zombie...); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_run_aiperf_without_export_fails(tmp_path):
    """aiperf exiting 0 without a summary is an error naming the folder, not an empty row."""
    binary = tmp_path / "aiperf"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match="wrote no profile_export_aiperf.json"):
        aiperf_client.run_aiperf(create_aiperf_run(tmp_path, binary), tmp_path / "aiperf.log", timeout_s=30)
