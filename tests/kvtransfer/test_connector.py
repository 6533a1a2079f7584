"""The KV connector's scheduler sides with a fake worker side: a scripted transport on the
prefill (its parts ack, fail, or never answer) and scripted per-rank polls on the decode side.
Lifecycle, lease expiry, failures reaching every rank, and every block freed."""
from __future__ import annotations

import time

import pytest
import torch

from engine.model_runner import ModelRunner
from engine.request import Request, SamplingParams
from kvtransfer.base import CompletedTransfer, KVSender, Transfer, TransferError
from kvtransfer.connector import DecodeConnector, PrefillConnector
from kvtransfer.params import KVEndpoint, KVTransferParams
from prefill_worker.worker import PrefillWorker
from tests.decode_worker.test_worker import FakeReceiver
from tests.helpers import engine_config, make_hf_tiny_llama, model_config_of

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class ScriptedTransfer(Transfer):
    def __init__(self, outcome: str):
        self.outcome, self.layers, self.finished = outcome, [], None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        self.layers.append((layer, tuple(kv.shape)))

    def finish(self, first_token: int, logprobs=None) -> None:
        self.finished = first_token

    def wait(self, timeout: float | None = None) -> None:
        if self.outcome == "hang":  # like a receiver that never acks: the wait runs out
            time.sleep(timeout or 0.0)
            raise TransferError(f"no acknowledgement within {timeout} s")
        if self.outcome == "fail":
            raise TransferError("connection reset")


class ScriptedSender(KVSender):
    def __init__(self, outcome: str):
        self.outcome, self.transfers = outcome, []

    def begin(self, request_id, dest, head_start, head_end, num_tokens) -> Transfer:
        t = ScriptedTransfer(self.outcome)
        self.transfers.append((request_id, dest.rank, head_start, head_end, num_tokens, t))
        return t

    stats = {}
    transfer_seconds = 0.0

    def close(self) -> None:
        pass


def prefill_worker(outcome: str, lease_s: float = 5.0) -> tuple[PrefillWorker, ScriptedSender]:
    hf = make_hf_tiny_llama()
    runner = ModelRunner(engine_config(num_blocks=32, block_size=8), model_config=model_config_of(hf),
                         weights=hf.state_dict().items())
    sender = ScriptedSender(outcome)
    connector = PrefillConnector(sender, runner.model_config.num_kv_heads, 0, 1, lease_s=lease_s)
    return PrefillWorker(runner, connector), sender


def run_until(worker: PrefillWorker, want: int, timeout_s: float = 30.0) -> list:
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < want and time.monotonic() < deadline:
        worker.step()
        results += worker.poll_results(0.01)
    return results


@pytest.mark.parametrize("outcome,lease_s", [("ack", 5.0), ("fail", 5.0), ("hang", 0.3)])
def test_prefill_blocks_stay_leased_until_the_transfer_ends(outcome, lease_s):
    """The first token is reported at once; the prompt's blocks are held until every part is
    acknowledged (then freed, nothing more reported), fails, or its lease runs out (then freed and
    the request reported failed, so the router retries it)."""
    worker, sender = prefill_worker(outcome, lease_s)
    params = KVTransferParams("r", "d", 2, (KVEndpoint("d", 0, "h", 1), KVEndpoint("d", 1, "h", 2)))
    worker.submit(Request("r", list(range(3, 23)), PARAMS), params)
    (first,) = run_until(worker, 1)
    assert first.first_token is not None and first.error is None
    heads = worker.runner.model_config.num_kv_heads
    assert [(rank, hs, he, n) for _, rank, hs, he, n, _ in sender.transfers] == [
        (0, 0, heads // 2, 20), (1, heads // 2, heads, 20)]  # decode tp=2: one part per rank
    for *_, t in sender.transfers:
        assert [layer for layer, _ in t.layers] == list(range(worker.runner.model_config.num_layers))
    assert [t.finished for *_, t in sender.transfers] == [first.first_token] * 2
    start = time.monotonic()
    results = run_until(worker, 1, timeout_s=1.0 if outcome == "ack" else 30.0)
    if outcome == "ack":
        assert results == []
    else:
        assert results[0].first_token is None and "KV transfer failed" in results[0].error
        assert time.monotonic() - start >= (lease_s * 0.5 if outcome == "hang" else 0.0)
    deadline = time.monotonic() + 10
    while worker.scheduler.kv.usage > 0 and time.monotonic() < deadline:
        worker.step()
    worker.scheduler.kv.assert_no_leaks()


class RecordingFollowers:
    def __init__(self):
        self.expected, self.forgotten = [], []

    def expect(self, request_id, slots, prefill_tp):
        self.expected.append((request_id, prefill_tp))

    def forget(self, request_id):
        self.forgotten.append(request_id)


def test_decode_connector_admits_only_what_every_rank_holds_and_forgets_failures_everywhere():
    rx = FakeReceiver()
    followers = RecordingFollowers()
    c = DecodeConnector(rx, num_kv_heads=2, tp_rank=0, tp_size=2)
    c.set_followers(followers)
    for rid in ("a", "b", "c"):
        c.reserve(rid, torch.arange(4), prefill_tp=1)
    assert rx.expected == {"a": 1, "b": 1, "c": 1} and [r for r, _ in followers.expected] == ["a", "b", "c"]
    done = {rid: CompletedTransfer(rid, 7, None) for rid in "abc"}
    polls = [([done["a"], done["b"]], []), ([done["a"]], [("b", "no KV for 1 s")])]
    ready, failed = c.admit(polls)
    assert ready == [done["a"]] and list(failed) == ["b"] and "rank 1" in failed["b"]
    assert followers.forgotten == ["b"] and "b" not in rx.expected
    assert c.admit([([done["b"]], []), ([done["b"]], [])]) == ([], {})  # late news of a failed one
    assert c.cancel("c") and followers.forgotten == ["b", "c"] and not c.cancel("c")
    assert c.admit([([done["c"]], []), ([done["c"]], [])]) == ([], {})
