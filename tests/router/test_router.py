"""The router against fake instances (no model): placement, policies, conditional
disaggregation, streams joined by position, stop, retries on failure, and no hangs."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from decode_worker.engine import RequestOutput
from engine.core.request import SamplingParams
from kvtransfer.params import KVEndpoint, Reservation
from prefill_worker.worker import PrefillResult
from router.client import DecodeClient, InstanceDeadError, InstanceInfo, InstanceLoad, PrefillClient
from router.policy import create_routing_policy
from router.router import Router

pytestmark = pytest.mark.timeout(30)
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class _FakeInstance:
    """What both fakes share: a death switch, an event queue for the long poll, abort and load."""

    def __init__(self, info: InstanceInfo):
        self.info, self.events, self.aborted, self.dead = info, queue.Queue(), [], False

    def _check(self):
        if self.dead:
            raise InstanceDeadError(self.info.instance_id, "fake death")

    def _poll(self, timeout):
        self._check()
        try:
            return [self.events.get(timeout=timeout)]
        except queue.Empty:
            return []

    def abort(self, request_id):
        self.aborted.append(request_id)

    def load(self):
        self._check()
        return dict(self.info.load.figures)


class FakePrefill(_FakeInstance, PrefillClient):
    def __init__(self, iid: str, load: float = 0.0):
        super().__init__(InstanceInfo(iid, "prefill", 1, load=InstanceLoad.of({"queued_prefill_tokens": load})))
        self.submitted, self.results = [], self.events

    def submit(self, msg, params):
        self._check()
        self.submitted.append((msg, params))

    def poll_outputs(self, timeout, client_id=""):
        return self._poll(timeout)


class FakeDecode(_FakeInstance, DecodeClient):
    def __init__(self, iid: str, capacity: int = 100, load: dict | None = None):
        super().__init__(InstanceInfo(iid, "decode", 1, (KVEndpoint(iid, 0, "127.0.0.1", 1),), load=InstanceLoad.of(load or {})))
        self.capacity, self.reserved, self.local, self.outputs = capacity, [], [], self.events
        self.cached_tokens = 0  # what its prefix cache holds of every prompt (a Reservation's)

    def reserve(self, msg, prefill_tp):
        self._check()
        if len(self.reserved) >= self.capacity:
            return None
        self.reserved.append(msg)
        return Reservation(self.cached_tokens)

    def add_request(self, msg):
        self._check()
        self.local.append((msg.request_id, list(msg.prompt_token_ids)))
        return True

    def poll_outputs(self, timeout, client_id=""):
        return self._poll(timeout)


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        threading.Event().wait(0.01)


def make_router(prefills, decodes, policy="round_robin", **kw) -> Router:
    r = Router(prefills, decodes, create_routing_policy(policy), poll_s=0.02, **kw)
    r.start()
    return r


@pytest.mark.parametrize("decode_first", [False, True])
def test_disaggregated_streams_join_by_position(decode_first):
    """Reserve on D, submit to P with D's endpoints; the first token comes from P (position 0), D's
    outputs begin at position 1: nothing is sent twice, so nothing is de-duplicated. D's outputs that
    come before P's first token wait for it."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    stream = r.submit("a", [1, 2, 3], PARAMS)
    (req, kv), = p.submitted
    assert req.request_id == "a#0" and d.reserved[0].request_id == "a#0" and kv.endpoints == d.info.kv_endpoints
    if not decode_first:
        p.results.put(PrefillResult("a#0", 11))
    d.outputs.put(RequestOutput("a#0", [12], False, start=1))
    d.outputs.put(RequestOutput("a#0", [13], True, "length", start=2))
    if decode_first:
        _wait_until(lambda: r._by_attempt["a#0"].held and len(r._by_attempt["a#0"].held) == 2)
        assert stream._events.qsize() == 0  # held: position 0 has not come
        p.results.put(PrefillResult("a#0", 11))
    assert stream.result(timeout=5).token_ids == [11, 12, 13] and stream.finish_reason == "length"
    r.close()


def test_the_prefill_ships_only_what_the_decode_instances_cache_lacks():
    """The decode instance's reservation says how much of the prompt its prefix cache holds; the
    prefill instance is told to ship the KV from there (delta transfer), on a retry too."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    d.cached_tokens = 8
    r = make_router([p], [d])
    r.submit("a", list(range(1, 20)), PARAMS)
    (_, kv), = p.submitted
    assert kv.decode_cached_tokens == 8
    r.close()


@pytest.mark.parametrize("decode_first", [False, True])
def test_logprobs_follow_their_tokens(decode_first):
    """Each token's logprobs reach the client once, with it, whichever side reports first."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    stream = r.submit("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1))
    lp = {t: {t: -t / 10, 99: -5.0} for t in (11, 12, 13)}
    first = PrefillResult("a#0", 11, extras={"logprobs": lp[11]})
    if not decode_first:
        p.results.put(first)
    d.outputs.put(RequestOutput("a#0", [12], False, start=1, new_extras=[{"logprobs": lp[12]}]))
    d.outputs.put(RequestOutput("a#0", [13], True, "length", start=2, new_extras=[{"logprobs": lp[13]}]))
    if decode_first:
        p.results.put(first)
    assert stream.result(timeout=5).token_ids == [11, 12, 13] and stream.logprobs == [lp[11], lp[12], lp[13]]
    r.close()


def test_overlapping_positions_are_dropped_not_repeated():
    """An output whose tokens start before what is delivered (no sound instance sends one) is
    dropped: the client never sees a token twice."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    stream = r.submit("a", [1, 2, 3], PARAMS)
    p.results.put(PrefillResult("a#0", 11))
    d.outputs.put(RequestOutput("a#0", [12], False, start=1))
    d.outputs.put(RequestOutput("a#0", [12], False, start=1))
    d.outputs.put(RequestOutput("a#0", [13], True, "length", start=2))
    assert stream.result(timeout=5).token_ids == [11, 12, 13]
    r.close()


def test_stop_ends_the_choice_and_counts_tokens_past_it():
    """A front end's stop: the stream ends with "stop" at once, the attempt is aborted on both
    instances, and the tokens delivered or arriving after the stop token count as tokens_past_stop."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d])
    stream = r.submit("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    p.results.put(PrefillResult("a#0", 11))
    d.outputs.put(RequestOutput("a#0", [12, 13], False, start=1))
    _wait_until(lambda: len(r._live["a"].delivered) == 3)
    r.stop("a", 0, num_tokens=2)  # token 12 completed the stop string: 13 is past it
    assert stream.result(timeout=5).finish_reason == "stop" and stream.token_ids == [11, 12, 13]
    d.outputs.put(RequestOutput("a#0", [14], False, start=3))  # generated before the abort landed
    _wait_until(lambda: r.stats["tokens_past_stop"] == 2)
    assert r.stats["tokens_past_stop"] == 2 and "a#0" in d.aborted and "a#0" in p.aborted
    assert r.num_placed == 0 and r.num_queued == 0
    r.close()


def test_round_robin_spreads_requests_over_decode_instances():
    """The decode policy is asked once per placement (asking per candidate pinned every request
    to the first instance under round robin)."""
    p, d0, d1 = FakePrefill("p0"), FakeDecode("d0"), FakeDecode("d1")
    r = make_router([p], [d0, d1])
    for i in range(4):
        r.submit(f"r{i}", [1, 2, 3], PARAMS)
    assert len(d0.reserved) == len(d1.reserved) == 2
    r.close()


def test_prefill_found_dead_at_submit_places_the_request_once():
    """The prefill dies between placement and submit: the request goes to the other prefill
    instance exactly once (it used to be queued as well, then submitted a second time), and a
    request already decoding from the dead prefill goes on without a retry."""
    p0, p1, d = FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0")
    r = make_router([p0, p1], [d])
    decoding = r.submit("old", [1, 2, 3], PARAMS)  # round robin: on p0
    p0.results.put(PrefillResult("old#0", 11))
    d.outputs.put(RequestOutput("old#0", [12], False, start=1))
    while not r._by_attempt["old#0"].decoding:
        pass
    p0.dead = True
    r.submit("a", [1, 2, 3], PARAMS)  # round robin: p1
    r.submit("b", [1, 2, 3], PARAMS)  # p0: its submit fails, the router learns p0 is dead, b goes to p1
    time.sleep(0.2)  # the placement thread would place a wrongly queued copy now
    ids = [req.request_id for req, _ in p1.submitted]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 2
    assert r.stats["retries"] <= 1 and "old#0" in r._by_attempt  # decoding one untouched
    d.outputs.put(RequestOutput("old#0", [13], True, "length", start=2))
    assert decoding.result(timeout=5).token_ids == [11, 12, 13]
    r.close()


def test_conditional_disaggregation_short_prompts_stay_on_decode():
    """Prompts shorter than the threshold are prefilled on the decode instance."""
    p, d = FakePrefill("p0"), FakeDecode("d0")
    r = make_router([p], [d], disagg_threshold_tokens=5)
    r.submit("short", [1, 2, 3], PARAMS)
    r.submit("long", list(range(10)), PARAMS)
    assert [rid for rid, _ in d.local] == ["short#0"] and [q.request_id for q, _ in p.submitted] == ["long#0"]
    r.close()


def test_prefill_failure_retries_on_another_pair():
    """P reports an error: the attempt is aborted on both and retried on the other prefill."""
    p0, p1, d = FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0")
    r = make_router([p0, p1], [d])
    stream = r.submit("a", [1, 2], PARAMS)
    first = p0 if p0.submitted else p1
    other = p1 if first is p0 else p0
    first.results.put(PrefillResult("a#0", None, "KV transfer failed"))
    for _ in range(200):
        if other.submitted:
            break
        threading.Event().wait(0.01)
    assert other.submitted[0][0].request_id == "a#1" and "a#0" in d.aborted
    other.results.put(PrefillResult("a#1", 5))
    d.outputs.put(RequestOutput("a#1", [6, 7], True, "length", start=1))
    assert stream.result(timeout=5).token_ids == [5, 6, 7] and r.stats["retries"] == 1
    r.close()


@pytest.mark.parametrize("prompt_len,limit,recompute", [(4, 8, True), (9, 8, False), (4, 0, False)])
def test_failed_kv_load_recomputes_on_the_decode_instance_when_short(prompt_len, limit, recompute):
    """The decode instance reports `kv_load_failed` after the first token was streamed: with the
    prompt (plus that token) within `kv_recompute_max_tokens`, the next attempt prefills on that
    same decode instance (add_request, prompt + the streamed token); longer prompts, or the retry
    policy (limit 0), go to another pair as for any failure. Either way nothing repeats."""
    p0, p1, d0, d1 = FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0"), FakeDecode("d1")
    r = make_router([p0, p1], [d0, d1], kv_recompute_max_tokens=limit)
    stream = r.submit("a", list(range(1, prompt_len)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    first, d, other = (p0 if p0.submitted else p1), (d0 if d0.reserved else d1), (d1 if d0.reserved else d0)
    first.results.put(PrefillResult("a#0", 11))
    _wait_until(lambda: stream._events.qsize())
    d.outputs.put(RequestOutput("a#0", [], True, "error", start=1, error="KV transfer to rank 0 failed: no KV",
                                kv_load_failed=True))
    _wait_until(lambda: d.local or other.reserved)
    want_prompt = list(range(1, prompt_len)) + [11]
    if recompute:
        assert d.local == [("a#1", want_prompt)] and r.stats["kv_recomputes"] == 1
        assert len(p0.submitted) + len(p1.submitted) == 1 and other.reserved == []
    else:
        assert d.local == [] and r.stats["kv_recomputes"] == 0
        assert other.reserved[0].request_id == "a#1" and other.reserved[0].prompt_token_ids == tuple(want_prompt)
        retry = p0 if p0.submitted and p0.submitted[-1][0].request_id == "a#1" else p1
        retry.results.put(PrefillResult("a#1", 12))  # the retry is disaggregated: its first token is P's
        d = other
    assert "a#0" in first.aborted
    d.outputs.put(RequestOutput("a#1", [13], True, "length", start=1) if not recompute else
                  RequestOutput("a#1", [12, 13], True, "length", start=0))
    assert stream.result(timeout=5).token_ids == [11, 12, 13] and stream.finish_reason == "length"
    r.close()


def test_dead_decode_retries_with_delivered_tokens():
    """D dies after 2 tokens: the retry's prompt is prompt + those tokens, asking for the rest."""
    p, d0, d1 = FakePrefill("p0"), FakeDecode("d0"), FakeDecode("d1")
    r = make_router([p], [d0, d1])
    stream = r.submit("a", [1, 2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first, second = (d0, d1) if d0.reserved else (d1, d0)
    p.results.put(PrefillResult("a#0", 8))
    first.outputs.put(RequestOutput("a#0", [9], False, start=1))
    for _ in range(200):
        if stream._events.qsize():
            break
        threading.Event().wait(0.01)
    first.dead = True
    for _ in range(300):
        if second.reserved:
            break
        threading.Event().wait(0.01)
    retry = second.reserved[0]
    assert retry.request_id == "a#1" and retry.prompt_token_ids == (1, 2, 8, 9)
    assert retry.sampling_params.max_tokens == 2 and retry.sampling_params.num_resumed_tokens == 2
    p.results.put(PrefillResult("a#1", 3))
    second.outputs.put(RequestOutput("a#1", [4], True, "length", start=1))
    assert stream.result(timeout=5).token_ids == [8, 9, 3, 4]
    r.close()


def test_everything_dead_ends_with_error_not_hang():
    p, d = FakePrefill("p0"), FakeDecode("d0")
    d.dead = True
    r = make_router([p], [d])
    stream = r.submit("a", [1, 2], PARAMS).result(timeout=5)
    assert stream.finish_reason == "error" and stream.error
    r.close()


def test_full_decode_queues_until_capacity():
    """Admission control: with no room on D the request waits, and is placed once room appears."""
    p, d = FakePrefill("p0"), FakeDecode("d0", capacity=0)
    r = make_router([p], [d])
    r.submit("a", [1], PARAMS)
    threading.Event().wait(0.1)
    assert not p.submitted and r.num_active == 1
    d.capacity = 1
    for _ in range(200):
        if p.submitted:
            break
        threading.Event().wait(0.01)
    assert p.submitted[0][0].request_id == "a#0"
    r.close()


def test_policies_pick_by_load_and_prefix():
    infos = [InstanceInfo("p0", "prefill", 1, load=InstanceLoad.of({"queued_prefill_tokens": 50.0})),
             InstanceInfo("p1", "prefill", 1, load=InstanceLoad.of({"queued_prefill_tokens": 5.0}))]
    assert create_routing_policy("least_loaded").pick_prefill(infos, [1]).instance_id == "p1"
    decodes = [InstanceInfo("d0", "decode", 1, load=InstanceLoad.of({"kv_usage": 0.9, "running": 1.0})),
               InstanceInfo("d1", "decode", 1, load=InstanceLoad.of({"kv_usage": 0.1, "running": 9.0}))]
    assert create_routing_policy("least_loaded").pick_decode(decodes, [1]).instance_id == "d1"
    # prefix_aware without an index entry: by load (tests/router/test_prefix_index.py: by prefix)
    assert create_routing_policy("prefix_aware").pick_prefill(infos, [1]).instance_id == "p1"
    rr = create_routing_policy("round_robin")
    assert [rr.pick_prefill(infos, [1]).instance_id for _ in range(3)] == ["p0", "p1", "p0"]
    with pytest.raises(ValueError):
        create_routing_policy("nope")
