"""bench/serving_vs_vllm.py without servers: its flags, the commands it would start, and the numbers
it computes from the load generator's records."""
from __future__ import annotations

import pytest

from bench import serving_vs_vllm as bench
from cluster.loadgen.loadgen import RequestRecord, request_specs


def create_record(index: int, chunk_s: list[float], end_s: float, send_s: float = 0.0,
                  error: str | None = None) -> RequestRecord:
    """A request sent at `send_s` (arrival 0) whose text chunks came at `chunk_s`, one token each."""
    return RequestRecord(index, max_tokens=len(chunk_s), num_prompt_tokens=3, arrival_s=0.0, send_s=send_s,
                         end_s=end_s, chunk_s=chunk_s, num_completion_tokens=None if error else len(chunk_s),
                         finish_reason=None if error else "length", status=500 if error else 200, error=error)


def test_unknown_target_is_a_one_line_error(capsys):
    """A target outside vllm/colocated/disaggregated/offline stops argparse with one line naming it
    and the choices."""
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--targets", "colocated,sglang"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("python -m bench.serving_vs_vllm: error: argument --targets: unknown target 'sglang' "
                   "(choose from vllm, colocated, disaggregated, offline)")


def test_targets_keep_their_order():
    """Targets run in the order given, each once."""
    assert bench.parse_args(["--targets", "offline, colocated,offline"]).targets == ("offline", "colocated")


def test_bad_workload_is_refused(capsys):
    """A workload value out of range is a usage error, not a traceback."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--targets", "offline", "--output-tokens", "1"])
    assert "num_output_tokens must be >= 2, got 1" in capsys.readouterr().err


def test_server_commands():
    """Every server runs float32 on 127.0.0.1:port; only `colocated` passes --mode colocated (the
    default is 1P1D); vLLM binds its OpenMP threads to the usable CPUs."""
    args = bench.parse_args(["--targets", "colocated", "--quantization", "none"])
    colocated, env, ready = bench.server_command("colocated", 9001, args)
    assert colocated[1:4] == ["-m", "cluster.cli.cli", "serve"] and ready == "/ready" and env == {}
    assert colocated[-2:] == ["--mode", "colocated"]
    disagg, _, _ = bench.server_command("disaggregated", 9001, args)
    assert "--mode" not in disagg and disagg[disagg.index("--quantization") + 1] == "none"
    assert disagg[disagg.index("--attention-backend") + 1] == "auto"
    vllm, env, ready = bench.server_command("vllm", 9002, args)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and ready == "/v1/models"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    for argv, port in ((colocated, "9001"), (disagg, "9001"), (vllm, "9002")):
        assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--port") + 1] == port
        assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_warmup_prompts_differ_from_measured_ones():
    """The warm-up draws other prompts (no prefix-cache hit for the measured requests) and is short."""
    wl = bench.Workload(num_requests=4, num_warmup=2)
    warm, measured = wl.load_config("http://x", warmup=True), wl.load_config("http://x")
    assert (warm.num_requests, warm.num_output_tokens) == (2, 8)
    assert (measured.num_requests, measured.num_output_tokens) == (4, 64)
    first = [next(request_specs(c)).prompt for c in (warm, measured)]
    assert first[0] != first[1] and len(first[1]) == 128


def test_target_row_from_records():
    """Throughput counts the ok requests' tokens over first arrival to last end (the failed request
    counted in the span); latencies are p50s over ok requests only, by hand:
        request 0: chunks at 0.5 0.6 0.7 0.8, end 0.9 -> TTFT 0.5, gaps 0.1 x3, TBT 0.1, e2e 0.9
        request 1: chunks at 1.0 1.1 1.2 1.9, end 2.0 -> TTFT 1.0, gaps 0.1 0.1 0.7, TBT 0.3, e2e 2.0
        request 2: HTTP 500, sent at 0.1, ended at 0.3
    -> 8 tokens / 2.0 s = 4 tok/s; TTFT p50 0.75; gap p50 0.1 (five 0.1s and a 0.7); TBT p50 0.2;
    e2e p50 1.45."""
    records = [create_record(0, [0.5, 0.6, 0.7, 0.8], 0.9), create_record(1, [1.0, 1.1, 1.2, 1.9], 2.0),
               create_record(2, [], 0.3, send_s=0.1, error="HTTP 500: boom")]
    row = bench.target_row(records)
    assert row["output_tok_s"] == pytest.approx(4.0) and row["duration_s"] == pytest.approx(2.0)
    assert row["ttft_p50_s"] == pytest.approx(0.75)
    assert row["itl_p50_s"] == pytest.approx(0.1)
    assert row["tbt_p50_s"] == pytest.approx(0.2)
    assert row["e2e_p50_s"] == pytest.approx(1.45)
    assert (row["num_ok"], row["num_failed"], row["num_output_tokens"]) == (2, 1, 8)
    assert row["errors"] == {"HTTP 500: boom": 1}


def test_ratios():
    """pdserve over vLLM and over its own offline run, for the pdserve servers measured; a missing
    or zero reference gives no ratio."""
    rows = {"vllm": {"output_tok_s": 50.0}, "colocated": {"output_tok_s": 100.0},
            "offline": {"output_tok_s": 125.0}}
    assert bench.ratios(rows) == pytest.approx({"colocated_over_vllm": 2.0, "colocated_over_offline": 0.8})
    rows = {"vllm": {"output_tok_s": 0.0}, "disaggregated": {"output_tok_s": 30.0}}
    assert bench.ratios(rows) == {}
