"""The KV connector's scheduler sides with a fake worker side: a scripted transport on the
prefill (its parts ack, fail, or never answer) and scripted per-rank polls on the decode side.
Lifecycle, lease expiry, failures reaching every rank, and every block freed."""
from __future__ import annotations

import time

import pytest
import torch

from engine.core.request import Handover, RequestMessage, SamplingParams
from engine.runner.model_runner import ModelRunner
from kvtransfer.base import CompletedTransfer, KVSender, Transfer, TransferError
from kvtransfer.connector import DecodeConnector, PrefillConnector
from kvtransfer.params import KVEndpoint, KVTransferParams
from prefill_worker.worker import PrefillWorker
from tests.decode_worker.test_worker import FakeReceiver
from tests.helpers import FAMILIES, engine_config, make_hf_tiny, make_hf_tiny_llama, model_config_of

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class ScriptedTransfer(Transfer):
    def __init__(self, outcome: str):
        self.outcome, self.layers, self.finished = outcome, [], None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        self.layers.append((layer, tuple(kv.shape)))

    def finish(self, trailer: bytes = b"") -> None:
        self.finished = trailer

    def wait(self, timeout: float | None = None) -> None:
        if self.outcome == "hang":  # like a receiver that never acks: the wait runs out
            time.sleep(timeout or 0.0)
            raise TransferError(f"no acknowledgement within {timeout} s")
        if self.outcome == "fail":
            raise TransferError("connection reset")


class ScriptedSender(KVSender):
    def __init__(self, outcome: str):
        self.outcome, self.transfers = outcome, []

    def begin(self, request_id, dest, head_start, head_end, num_tokens, slots=None, trace="") -> Transfer:
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


def test_prefill_ships_each_kv_group_what_its_window_reads(tmp_path):
    """Tiny Gemma 2 (layers sliding 24, global, sliding 24: three KV groups of one layer): a
    60-token prompt leaves as three transfers, each the group's only slab as layer 0: the sliding
    groups' last 23 tokens, the global group's 60."""
    kind, switches = FAMILIES["gemma2"]
    make_hf_tiny(kind, seed=3, **switches).save_pretrained(tmp_path, safe_serialization=True)
    runner = ModelRunner(engine_config(model=str(tmp_path), num_blocks=64, block_size=8))
    layout, sender = runner.model_config.kv_layout, ScriptedSender("ack")
    assert layout.windows == (24, None, 24)
    connector = PrefillConnector(sender, runner.model_config.num_kv_heads, 0, 1, 5.0, kv_layout=layout)
    worker = PrefillWorker(runner, connector)
    params = KVTransferParams("r", "d", 1, (KVEndpoint("d", 0, "h", 1),))
    worker.submit(RequestMessage("r", list(range(3, 63)), PARAMS), params)
    (first,) = run_until(worker, 1)
    heads = runner.model_config.num_kv_heads
    assert [(rid, n) for rid, _, _, _, n, _ in sender.transfers] == [("r#kv0", 23), ("r#kv1", 60), ("r#kv2", 23)]
    for *_, n, t in sender.transfers:
        assert t.layers == [(0, (2, n, heads, runner.model_config.head_dim))]
    # the handover rides on group 0's part to decode rank 0 only
    assert [t.finished != b"" for *_, t in sender.transfers] == [True, False, False]
    assert Handover.unpack(sender.transfers[0][-1].finished).first_token == first.first_token


def run_until(worker: PrefillWorker, want: int, timeout_s: float = 30.0) -> list:
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < want and time.monotonic() < deadline:
        worker.step()
        results += worker.poll_outputs(0.01)
    return results


@pytest.mark.parametrize("outcome,lease_s", [("ack", 5.0), ("fail", 5.0), ("hang", 0.3)])
def test_prefill_blocks_stay_leased_until_the_transfer_ends(outcome, lease_s):
    """The first token is reported at once; the prompt's blocks are held until every part is
    acknowledged (then freed, nothing more reported), fails, or its lease runs out (then freed and
    the request reported failed, so the router retries it)."""
    worker, sender = prefill_worker(outcome, lease_s)
    params = KVTransferParams("r", "d", 2, (KVEndpoint("d", 0, "h", 1), KVEndpoint("d", 1, "h", 2)))
    worker.submit(RequestMessage("r", list(range(3, 23)), PARAMS), params)
    (first,) = run_until(worker, 1)
    assert first.first_token is not None and first.error is None
    heads = worker.runner.model_config.num_kv_heads
    assert [(rank, hs, he, n) for _, rank, hs, he, n, _ in sender.transfers] == [
        (0, 0, heads // 2, 20), (1, heads // 2, heads, 20)]  # decode tp=2: one part per rank
    for *_, t in sender.transfers:
        assert [layer for layer, _ in t.layers] == list(range(worker.runner.model_config.num_layers))
    to_rank0, to_rank1 = (t.finished for *_, t in sender.transfers)  # the handover goes to decode rank 0
    assert Handover.unpack(to_rank0).first_token == first.first_token and to_rank1 == b""
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
    """Each rank's poll names the transfers complete there; rank 0 keeps their trailers, which never
    cross the TP group, and hands each out with its request once every rank holds it."""
    rx = FakeReceiver()
    followers = RecordingFollowers()
    c = DecodeConnector(rx, num_kv_heads=2, tp_rank=0, tp_size=2)
    c.set_followers(followers)
    for rid in ("a", "b", "c"):
        c.reserve(rid, [torch.arange(4)], prefill_tp=1)
    assert rx.expected == {"a": 1, "b": 1, "c": 1} and [r for r, _ in followers.expected] == ["a", "b", "c"]
    rx.done = [CompletedTransfer("a", b"of a"), CompletedTransfer("b", b"of b")]
    rank0 = c.poll()
    assert rank0 == (["a", "b"], [])  # ids only: what crosses the TP group
    ready, failed = c.admit([rank0, (["a"], [("b", "no KV for 1 s")])])
    assert ready == [CompletedTransfer("a", b"of a")] and list(failed) == ["b"] and "rank 1" in failed["b"]
    assert followers.forgotten == ["b"] and "b" not in rx.expected and c._trailers == {}
    assert c.admit([(["b"], []), (["b"], [])]) == ([], {})  # late news of a failed one
    assert c.cancel("c") and followers.forgotten == ["b", "c"] and not c.cancel("c")
    assert c.admit([(["c"], []), (["c"], [])]) == ([], {})


def test_a_follower_rank_keeps_no_trailers():
    rx = FakeReceiver()
    c = DecodeConnector(rx, num_kv_heads=2, tp_rank=1, tp_size=2)
    c.expect("a", [torch.arange(4)], prefill_tp=1)
    rx.done = [CompletedTransfer("a", b"")]
    assert c.poll() == (["a"], []) and c._trailers == {}


def test_decode_connector_admits_a_request_once_every_kv_group_arrived():
    """Two KV groups (sliding and global layers): a transfer each, `a#kv0` and `a#kv1`; the request
    is ready, under its own id with group 0's trailer, only when both are complete on every rank."""
    rx = FakeReceiver()
    c = DecodeConnector(rx, num_kv_heads=2, tp_rank=0, tp_size=2, num_groups=2)
    c.set_followers(RecordingFollowers())
    c.reserve("a", [torch.arange(4), torch.arange(8, 16)], prefill_tp=1)
    assert rx.expected == {"a#kv0": 1, "a#kv1": 1}
    rx.done = [CompletedTransfer("a#kv0", b"handover")]
    assert c.admit([c.poll(), (["a#kv0", "a#kv1"], [])]) == ([], {})  # rank 0 lacks group 1
    rx.done = [CompletedTransfer("a#kv1", b"")]
    ready, failed = c.admit([c.poll(), ([], [])])
    assert ready == [CompletedTransfer("a", b"handover")] and not failed and not c.awaiting
    c.reserve("b", [torch.arange(4), torch.arange(4)], prefill_tp=1)
    ready, failed = c.admit([([], [("b#kv1", "no KV for 1 s")]), ([], [])])
    assert not ready and list(failed) == ["b"] and not rx.expected.keys() & {"b#kv0", "b#kv1"}
