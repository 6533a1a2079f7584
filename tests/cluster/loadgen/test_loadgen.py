"""`pdserve bench`'s load generator against the real gateway app over a fake cluster (uvicorn on
127.0.0.1): arrivals, the concurrency cap, per-request records, failures, the report, the files
and the command line."""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.cli.cli import build_parser, main
from cluster.cli.serve import serve_in_thread
from cluster.loadgen.loadgen import LoadConfig, RequestRecord, arrival_times, load_dataset, request_specs, run_load
from cluster.loadgen.loadgen_report import Slo, summarize, write_outputs
from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from router.router import QueueFullError
from router.tables import StreamEvent
from tests.gateway.fakes import TOKENS, FakeCluster

pytestmark = pytest.mark.timeout(120)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class LoadFakeCluster(FakeCluster):
    """FakeCluster with a delay before each token, a count of requests being generated, and
    failures by output length: `max_tokens == queue_full_at` -> HTTP 429, `== fail_at` -> an
    error after two tokens."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.submitted.clear()
        self.token_delay_s, self.queue_full_at, self.fail_at = 0.0, None, None
        self.active = self.max_active = 0

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        if params.max_tokens == self.queue_full_at:
            raise QueueFullError("test: full")
        self.submitted.append((request_id, prompt_token_ids, params))
        n, delay, fail = min(params.max_tokens, len(TOKENS)), self.token_delay_s, params.max_tokens == self.fail_at
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

        def emit():
            try:
                for i, t in enumerate(TOKENS[:n]):
                    time.sleep(delay)
                    if fail and i == 2:
                        listener(StreamEvent([], True, "error", error="test: decode instance died"))
                        return
                    listener(StreamEvent([t]))
                listener(StreamEvent([], True, "length" if n == params.max_tokens else "stop"))
            finally:
                with self.lock:
                    self.active -= 1
        threading.Thread(target=emit, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_path(resolve_model_path("smollm2"))


@pytest.fixture(scope="module")
def served(tokenizer):
    cluster = LoadFakeCluster()
    url, stop = serve_in_thread(create_app(cluster, tokenizer, "smollm2", FakeCluster.max_model_len))
    yield cluster, url
    stop()


@pytest.fixture
def server(served):
    cluster, url = served
    cluster.reset()
    return cluster, url


def run(url: str, **kw):
    kw = {"num_prompt_tokens": 16, "num_output_tokens": 4, "progress": False, **kw}
    return asyncio.run(run_load(LoadConfig(url=url, **kw)))


@pytest.mark.parametrize("output_tokens", [4, 12])
def test_fixed_rate_run_completes_every_request(server, output_tokens):
    """N requests at a fixed rate all succeed with their token counts (at most the fake's 7);
    each is scheduled at i/rate, sent no earlier, and its first token and end come in order."""
    cluster, url = server
    config = LoadConfig(url=url, rate=25.0, arrival="fixed", num_requests=6, num_prompt_tokens=16,
                        num_output_tokens=output_tokens, progress=False)
    result = asyncio.run(run_load(config))
    recs = result.records
    assert result.model == "smollm2" and [r.index for r in recs] == list(range(6))
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert [r.arrival_s for r in recs] == pytest.approx([i / 25.0 for i in range(6)])
    for r in recs:
        assert r.num_prompt_tokens == 16 and r.num_completion_tokens == min(output_tokens, len(TOKENS))
        assert r.arrival_s <= r.send_s <= r.chunk_s[0] <= r.chunk_s[-1] <= r.end_s
        assert r.ttft_s == r.chunk_s[0] - r.send_s and r.e2e_s == r.end_s - r.send_s
        assert r.tbt_s == pytest.approx((r.chunk_s[-1] - r.chunk_s[0]) / (r.num_completion_tokens - 1))
    assert [r.send_s for r in recs] == sorted(r.send_s for r in recs)
    # the probe (the first prompt, 1 output token), then the 6 seeded prompts of exactly 16 ids
    sent, want = cluster.submitted, [s.prompt for s in itertools.islice(request_specs(config), 6)]
    assert [p.max_tokens for _, _, p in sent] == [1] + [output_tokens] * 6
    assert sent[0][1] == want[0] and sorted(ids for _, ids, _ in sent[1:]) == sorted(want)
    assert all(len(ids) == 16 and all(100 <= t < 20000 for t in ids) for ids in want)
    s = summarize(recs)
    assert s["num_ok"] == 6 and s["num_failed"] == 0 and s["duration_s"] >= 5 / 25.0
    assert s["num_output_tokens"] == 6 * min(output_tokens, len(TOKENS))


def test_concurrency_cap_is_respected(server):
    """With slow generation and every request arriving at once, no more than the cap is ever in
    flight, at the server or by the records; the cap is reached and later requests wait for it."""
    cluster, url = server
    cluster.token_delay_s = 0.02
    result = run(url, num_requests=12, concurrency=3)
    recs = result.records
    assert all(r.ok for r in recs) and len(recs) == 12
    assert cluster.max_active == 3
    assert summarize(recs)["max_in_flight"] == 3
    assert all(r.arrival_s == 0.0 for r in recs) and recs[-1].send_s >= 3 * 4 * 0.02


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    """Poisson schedules repeat for a seed, change with it, start at 0 and average 1/rate with
    exponential spread; fixed ones are evenly spaced; rate 0 or inf sends all at once."""
    def times(n=4000, **kw):
        return list(itertools.islice(arrival_times(LoadConfig(num_requests=1, **kw)), n))

    a, b, c = times(rate=50.0, seed=1), times(rate=50.0, seed=1), times(rate=50.0, seed=2)
    assert a == b and a != c and a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)  # exponential: std == mean
    assert np.diff(times(rate=50.0, arrival="fixed")) == pytest.approx(np.full(3999, 0.02))
    assert times(n=5, rate=0.0) == times(n=5, rate=math.inf) == [0.0] * 5


def test_poisson_run_sends_on_schedule(server):
    """A live Poisson run schedules its requests at the seeded times and sends none early."""
    _, url = server
    result = run(url, rate=40.0, num_requests=10, seed=3)
    want = list(itertools.islice(arrival_times(LoadConfig(num_requests=10, rate=40.0, seed=3)), 10))
    assert [r.arrival_s for r in result.records] == want
    assert all(r.ok and r.send_s >= r.arrival_s for r in result.records)


def test_goodput_under_slos(server):
    """Goodput is 0 under an impossible TTFT or TBT target and equals the ok throughput under loose
    ones or none; the attainment fraction follows."""
    cluster, url = server
    cluster.token_delay_s = 0.005
    recs = run(url, num_requests=6, concurrency=2).records
    none, loose = summarize(recs), summarize(recs, Slo(ttft_s=60.0, tbt_s=60.0))
    assert none["request_throughput"] > 0
    for s in (none, loose):
        assert s["goodput"] == s["request_throughput"] and s["slo_attainment"] == 1.0
    for slo in (Slo(ttft_s=1e-9), Slo(tbt_s=1e-9)):
        s = summarize(recs, slo)
        assert s["goodput"] == 0.0 and s["slo_attainment"] == 0.0 and s["request_throughput"] > 0


def test_summarize_from_known_records():
    """Percentiles, TBT, duration, throughput, in-flight and goodput from hand-made records; a
    failed request counts as failed and against the SLO fraction, never in the latencies."""
    def rec(i, send, chunks, end, n, error=None):
        return RequestRecord(i, n, 8, 0.0, send_s=send, end_s=end, chunk_s=chunks, num_completion_tokens=n,
                             error=error)

    recs = [rec(0, 0.0, [0.1, 0.2, 0.3], 0.3, 3), rec(1, 0.5, [0.8, 1.0], 1.0, 5),
            rec(2, 1.0, [1.1], 1.5, 1), rec(3, 1.2, [], 2.0, None, error="HTTP 503: x")]
    s = summarize(recs, Slo(ttft_s=0.2))
    assert (s["num_ok"], s["num_failed"], s["errors"]) == (3, 1, {"HTTP 503: x": 1})
    assert s["duration_s"] == 2.0 and s["request_throughput"] == 1.5 and s["output_token_throughput"] == 4.5
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["ttft_s"]["max"] == pytest.approx(0.3)
    assert s["tbt_s"]["mean"] == pytest.approx((0.1 + 0.05) / 2)  # (last - first) / (n - 1); n=1 has none
    assert s["inter_chunk_s"]["p50"] == pytest.approx(0.1)  # gaps 0.1, 0.1, 0.2
    assert s["e2e_s"]["mean"] == pytest.approx((0.3 + 0.5 + 0.5) / 3)
    assert s["max_in_flight"] == 2  # 1 and 2 overlap; 1 ends as 2 starts
    assert s["goodput"] == 1.0 and s["slo_attainment"] == 0.5  # 0 and 2 meet TTFT <= 0.2 of 4


def test_dataset_and_failed_requests_are_recorded(server, tokenizer, tmp_path):
    """Dataset lines give the prompts (text or ids) and output lengths, repeated in order; a 429
    and an error event mid-stream are failed requests with their reasons, the rest succeed."""
    cluster, url = server
    cluster.queue_full_at, cluster.fail_at = 4, 5
    lines = [{"prompt": "The capital of France is", "output_tokens": 3}, {"prompt": [500, 600], "output_tokens": 4},
             {"prompt": [700] * 9, "output_tokens": 5}]
    path = tmp_path / "ds.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    recs = run(url, num_requests=6, dataset=str(path)).records
    assert [r.max_tokens for r in recs] == [3, 4, 5] * 2
    assert [r.ok for r in recs] == [True, False, False] * 2
    assert recs[0].num_prompt_tokens == len(tokenizer.encode(lines[0]["prompt"]))  # text: counted by the server
    assert recs[0].num_completion_tokens == 3
    assert recs[1].status == 429 and recs[1].error.startswith("HTTP 429: ")
    assert recs[2].status == 200 and "decode instance died" in recs[2].error and len(recs[2].chunk_s) >= 1
    s = summarize(recs)
    assert s["num_ok"] == 2 and s["num_failed"] == 4 and sum(s["errors"].values()) == 4
    assert sorted(p.max_tokens for _, _, p in cluster.submitted if p.max_tokens > 1) == [3, 3, 5, 5]


def test_bad_dataset_names_the_line(tmp_path):
    """A malformed dataset line is a ValueError naming the file and line."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "output_tokens": 2}\n{"prompt": [1, "x"]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        load_dataset(str(path))


def test_writes_json_and_plots(server, tmp_path):
    """`write_outputs` writes result.json (summary, every record, no API key) and both PNGs."""
    _, url = server
    result = run(url, num_requests=4, rate=50.0, api_key="secret-key")
    paths = write_outputs(result, summarize(result.records), tmp_path / "out")
    assert [p.name for p in paths] == ["result.json", "latency_cdf.png", "timeline.png"]
    doc = json.loads(paths[0].read_text())
    assert doc["summary"]["num_ok"] == 4 and len(doc["requests"]) == 4 and doc["model"] == "smollm2"
    assert doc["requests"][0]["ttft_s"] > 0 and "secret-key" not in paths[0].read_text()
    for p in paths[1:]:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_wrong_model_or_unreachable_server_is_a_clear_error(server):
    """A model the server lacks fails on the first request with its 404; a closed port says it
    cannot reach the server; neither sends the load."""
    cluster, url = server
    with pytest.raises(ValueError, match=r"first request failed: HTTP 404: .*'gpt-4'"):
        run(url, num_requests=3, model="gpt-4")
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=f"cannot reach {dead}"):
        run(dead, num_requests=3)
    with pytest.raises(ValueError, match=f"cannot reach {dead}"):
        run(dead, num_requests=3, model="smollm2")
    assert cluster.submitted == []


def test_api_key_is_sent(tokenizer):
    """The key goes out as a bearer token: with it the run succeeds, without it the 401 is the error."""
    url, stop = serve_in_thread(create_app(LoadFakeCluster(), tokenizer, "smollm2", 256, api_key="k3y"))
    try:
        assert all(r.ok for r in run(url + "/v1", num_requests=2, api_key="k3y").records)
        with pytest.raises(ValueError, match="HTTP 401"):
            run(url, num_requests=2)
    finally:
        stop()


def test_cli_load_mode(server, tmp_path, capsys):
    """`pdserve bench --url ... --num-requests 3 --out DIR` prints the table and writes the files;
    a wrong model or a cluster spec flag without --profile is `pdserve: error: ...` with status 2."""
    _, url = server
    out = tmp_path / "run"
    rc = main(["bench", "--url", url, "--num-requests", "3", "--prompt-tokens", "8", "--output-tokens", "3",
               "--ttft-slo", "30", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0 and "3 ok, 0 failed" in printed and "TTFT" in printed and "TTFT <= 30000 ms" in printed
    doc = json.loads((out / "result.json").read_text())
    assert len(doc["requests"]) == 3 and doc["config"]["num_prompt_tokens"] == 8
    assert (out / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)
    assert main(["bench", "--url", url, "--served-model-name", "nope", "--no-progress"]) == 2
    assert "pdserve: error: the first request failed: HTTP 404" in capsys.readouterr().err
    assert main(["bench", "--url", url, "--num-decode", "2"]) == 2
    assert "--num-decode: cluster spec flags only apply with --profile" in capsys.readouterr().err


def test_profile_mode_still_parses_and_dispatches(monkeypatch, tmp_path):
    """`bench --profile OUT.json` with spec flags parses as before and runs the profiler, not the load."""
    from cluster.spec import ClusterSpec
    args = build_parser().parse_args(["bench", "--profile", "p.json", "--num-decode", "2", "--dtype", "float32"])
    assert args.profile == "p.json" and ClusterSpec.from_args(args).num_decode == 2
    assert ClusterSpec.from_args(args).dtype == "float32"
    default = build_parser().parse_args(["bench"])
    assert default.profile is None and default.rate == math.inf and default.url == "http://127.0.0.1:8000"
    seen = []
    profile = SimpleNamespace(prefill_tokens_per_s=1.0, decode_itl_base_s=0.01, decode_itl_per_seq_s=0.001,
                              kv_capacity_tokens=64, startup_s=1.0, save=lambda path, **raw: seen.append(path))
    monkeypatch.setattr("cluster.autoscale.profiler.measure_profile",
                        lambda spec: (seen.append(spec), (profile, {}))[1])
    assert main(["bench", "--profile", str(tmp_path / "p.json"), "--num-decode", "2"]) == 0
    assert seen[0].num_decode == 2 and seen[1] == str(tmp_path / "p.json")
