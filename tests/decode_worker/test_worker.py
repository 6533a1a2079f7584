"""The decode worker's admission of transferred requests (a fake receiver, a tiny model): the
first token and its logprobs come from the transfer, the rest from the decode steps."""
from __future__ import annotations

import torch

from decode_worker.engine import DecodeWorker
from engine.core.request import Handover, RequestMessage, SamplingParams
from kvtransfer.base import CompletedTransfer, KVReceiver
from kvtransfer.connector import DecodeConnector
from tests.helpers import make_hf_tiny_llama, tiny_engine


class FakeReceiver(KVReceiver):
    """Reports whatever the test puts in `done` as complete at the next poll."""

    def __init__(self):
        self.done: list[CompletedTransfer] = []
        self.failed: list[tuple[str, str]] = []
        self.expected: dict[str, int] = {}

    endpoint_address = ("127.0.0.1", 0)
    stats = {}

    def expect(self, request_id: str, slots: torch.Tensor, num_parts: int) -> None:
        self.expected[request_id] = num_parts

    def poll(self):
        done, self.done = self.done, []
        failed, self.failed = self.failed, []
        return done, failed

    def cancel(self, request_id: str) -> None:
        self.expected.pop(request_id, None)

    def close(self) -> None:
        pass


def test_transferred_logprobs_lead_and_missing_ones_fail_the_request():
    """A request that asked for logprobs streams one map per decoded token from position 1 (the
    first token and its logprobs are the prefill's to hand over); one whose first token came without them ends with an error (the
    router retries it) instead of streaming tokens without logprobs."""
    engine = tiny_engine(make_hf_tiny_llama(), num_blocks=32, block_size=8)
    rx = FakeReceiver()
    worker = DecodeWorker(engine, DecodeConnector(rx, engine.runner.model_config.num_kv_heads, 0, 1))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    for rid in ("ok", "bad"):
        assert worker.reserve(RequestMessage(rid, list(range(3, 20)), params), prefill_tp=1)
    assert rx.expected == {"ok": 1, "bad": 1}
    rx.done = [CompletedTransfer("ok", Handover(5, {"logprobs": {5: -0.5}}).pack()),
               CompletedTransfer("bad", Handover(5).pack())]  # without the logprobs asked for
    outputs = []
    for _ in range(10):
        worker.step()
        outputs += worker.poll_outputs(0)
    ok = [o for o in outputs if o.request_id == "ok"]
    (bad,) = [o for o in outputs if o.request_id == "bad"]
    assert bad.finished and bad.error and "logprobs" in bad.error and bad.new_token_ids == []
    tokens = [t for o in ok for t in o.new_token_ids]
    logprobs = [e["logprobs"] for o in ok for e in o.new_extras]
    # the first token (and its logprobs) is the prefill's to hand over: this instance's outputs begin after it
    assert ok[-1].finished and ok[0].start == 1 and len(tokens) == len(logprobs) == 2
    assert all(next(iter(lp)) == t and len(lp) in (1, 2) for t, lp in zip(tokens, logprobs))
    engine.kv.assert_no_leaks()


def reserved_pair(*rids: str):
    """A decode worker on a tiny model with a fake receiver, `rids` reserved (3 tokens each)."""
    engine = tiny_engine(make_hf_tiny_llama(), num_blocks=32, block_size=8)
    rx = FakeReceiver()
    worker = DecodeWorker(engine, DecodeConnector(rx, engine.runner.model_config.num_kv_heads, 0, 1))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid in rids:
        assert worker.reserve(RequestMessage(rid, list(range(3, 20)), params), prefill_tp=1)
    return engine, rx, worker


def step_outputs(worker: DecodeWorker, steps: int = 10) -> list:
    outputs = []
    for _ in range(steps):
        worker.step()
        outputs += worker.poll_outputs(0)
    return outputs


def test_a_failed_load_ends_the_request_with_kv_load_failed_and_frees_its_blocks():
    """The receiver reports a failed load: the request ends with an error flagged
    `kv_load_failed` (the router may recompute it here), its blocks are free, and the others
    decode on."""
    engine, rx, worker = reserved_pair("ok", "lost")
    rx.done = [CompletedTransfer("ok", Handover(5).pack())]
    rx.failed = [("lost", "no KV for 10 s after the transfer began")]
    outputs = step_outputs(worker)
    (lost,) = [o for o in outputs if o.request_id == "lost"]
    assert lost.finished and lost.kv_load_failed and "no KV" in lost.error and "lost" not in rx.expected
    assert [o for o in outputs if o.request_id == "ok"][-1].finish_reason == "length"
    engine.kv.assert_no_leaks()


class CountingTP:
    """Rank 0 of a two-rank group whose follower never answers anything but empty polls; counts
    the collective calls the driver makes."""
    rank, size = 0, 2

    def __init__(self):
        self.calls = 0

    def broadcast_step(self, obj=None):
        self.calls += 1
        return obj

    def all_gather_object(self, obj):
        self.calls += 1
        return [obj, (([], []), [])]  # (its connector's poll, its disk tier's reads ended)


def test_an_idle_decode_instance_makes_no_collective_call():
    """With TP, rank 0 broadcasts a step and gathers the ranks' polls only while a batch runs or
    a reserved request's KV is arriving; idle steps call no collective at all."""
    engine = tiny_engine(make_hf_tiny_llama(), num_blocks=32, block_size=8)
    rx = FakeReceiver()
    worker = DecodeWorker(engine, DecodeConnector(rx, engine.runner.model_config.num_kv_heads, 0, 1))
    worker.tp = tp = CountingTP()
    for _ in range(5):
        assert not worker.step()
    assert tp.calls == 0
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert worker.reserve(RequestMessage("r", list(range(3, 20)), params), prefill_tp=1)
    worker.step()
    assert tp.calls == 2  # awaiting KV: the ranks' polls are gathered
    rx.done = [CompletedTransfer("r", Handover(5).pack())]
    while worker.has_work():
        worker.step()
    worker.step()  # tells the runner the request finished
    calls = tp.calls
    for _ in range(5):
        assert not worker.step()
    assert tp.calls == calls
    engine.kv.assert_no_leaks()


def test_a_malformed_handover_fails_its_request_only():
    """A trailer that is no handover (engine/core/request.py): that request ends with an error flagged
    `kv_load_failed`, its blocks freed, counted among the dropped KV messages; another decodes on."""
    engine, rx, worker = reserved_pair("ok", "bad")
    rx.done = [CompletedTransfer("ok", Handover(5).pack()), CompletedTransfer("bad", b"\x93\x01\x02\x03")]
    outputs = step_outputs(worker)
    (bad,) = [o for o in outputs if o.request_id == "bad"]
    assert bad.finished and bad.kv_load_failed and "handover is malformed" in bad.error
    assert [o for o in outputs if o.request_id == "ok"][-1].finish_reason == "length"
    assert worker.load()["kv_messages_dropped"] == 1
    engine.kv.assert_no_leaks()
