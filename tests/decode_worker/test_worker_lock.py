"""What the decode worker's lock covers: reserve() (every gateway's admission, with a 5 s deadline)
never waits for a step's runner work, and an abort during a step frees its blocks only once the
step has stopped writing them."""
from __future__ import annotations

import json
import threading
import time

import pytest

from decode_worker.engine import ColocatedEngine, DecodeWorker
from engine.core.request import RequestMessage, SamplingParams
from gateway import protocol
from kvtransfer.connector import DecodeConnector
from tests.decode_worker.test_worker import FakeReceiver
from tests.helpers import engine_config, make_hf_tiny_llama, tiny_engine

WAIT_S = 30.0  # a blocked call that this long has not returned is stuck (each returns in milliseconds)


def _worker(engine) -> tuple[DecodeWorker, FakeReceiver]:
    rx = FakeReceiver()
    return DecodeWorker(engine, DecodeConnector(rx, engine.runner.model_config.num_kv_heads, 0, 1)), rx


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _reserve(worker: DecodeWorker, rid: str, prompt_len: int = 17) -> bool:
    return worker.reserve(RequestMessage(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=2)),
                          prefill_tp=1) is not None


def test_reserve_does_not_wait_for_a_new_requests_grammar():
    """A step that is building a new request's runner state (its grammar: llguidance's tokenizer,
    a matcher fed the request's output so far) holds no lock: a reservation made meanwhile returns."""
    engine = tiny_engine(make_hf_tiny_llama(), num_blocks=32, block_size=8)
    worker, _ = _worker(engine)
    building, release = threading.Event(), threading.Event()
    grammar_for = engine.runner.grammars.grammar_for

    def slow_grammar_for(r, old):
        building.set()
        assert release.wait(WAIT_S)
        return grammar_for(r, old)

    engine.runner.grammars.grammar_for = slow_grammar_for
    worker.add_request(RequestMessage("colocated", list(range(3, 12)), SamplingParams(max_tokens=2)))
    stepper = _in_thread(worker.step)
    assert building.wait(WAIT_S)
    reserved = []
    reserver = _in_thread(lambda: reserved.append(_reserve(worker, "r")))
    reserver.join(WAIT_S)
    stuck = reserver.is_alive()
    release.set()
    stepper.join(WAIT_S)
    assert not stuck, "reserve() waited for the step's grammar"
    assert reserved == [True]
    worker.abort("r")
    while worker.has_work():
        worker.step()
    worker.step()
    engine.kv.assert_no_leaks()


def test_an_abort_during_a_step_frees_the_blocks_after_it():
    """A request aborted while its step runs keeps its blocks until the step ends (a reservation
    taking them could see the step's writes), then frees them all; its client gets nothing more."""
    engine = tiny_engine(make_hf_tiny_llama(), num_blocks=32, block_size=8)
    worker, _ = _worker(engine)
    worker.add_request(RequestMessage("a", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True)))
    worker.step()  # its prefill
    worker.poll_outputs(0)
    free = engine.kv.num_free_blocks
    executing, release = threading.Event(), threading.Event()
    execute_model = engine.runner.execute_model

    def slow_execute(inp, *args, **kwargs):
        executing.set()
        assert release.wait(WAIT_S)
        return execute_model(inp, *args, **kwargs)

    engine.runner.execute_model = slow_execute
    stepper = _in_thread(worker.step)
    assert executing.wait(WAIT_S)
    worker.abort("a")
    held = engine.kv.num_free_blocks
    release.set()
    stepper.join(WAIT_S)
    assert not stepper.is_alive()
    assert held == free  # not freed while the step could write them
    assert not engine.scheduler.requests and worker.poll_outputs(0) == []
    worker.step()  # tells the runner the request ended
    engine.kv.assert_no_leaks()


@pytest.fixture(scope="module")
def smollm2_engine():
    # room for the 128 choices and the reservations whose aborts wait for a step's end: a step takes
    # seconds on a loaded host, and with 160 sequences at most a third of the reservations were refused
    cfg = engine_config(num_blocks=768, block_size=16, max_num_seqs=512, max_num_batched_tokens=512)
    return ColocatedEngine(cfg)


def test_reserve_p99_stays_under_a_second_while_a_request_at_the_bounds_decodes(smollm2_engine):
    """One request at every bound the gateway allows (128 choices, 1024 stop ids, 300 logit biases, a
    JSON schema of 60 fields) decodes on SmolLM2 while a gateway reserves every 20 ms: a reservation's
    p99 stays under 1 s (a gateway's deadline is 5 s; the old stop check under the lock made a step ~9 s)."""
    engine = smollm2_engine
    worker, _ = _worker(engine)
    fields = {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(60)}
    schema = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
    vocab = engine.runner.model_config.vocab_size
    heavy = SamplingParams(n=protocol.MAX_N, max_tokens=8, temperature=1.0, seed=1,
                           stop_token_ids=tuple(range(vocab - protocol.MAX_STOP_TOKEN_IDS, vocab)),
                           logit_bias={i: 0.5 for i in range(1000, 1000 + protocol.MAX_LOGIT_BIAS)},
                           structured_output=("json_schema", json.dumps(schema)))
    engine.runner.grammar_tokenizer()  # once per runner, ~0.4 s holding the GIL: not what this measures
    worker.add_request(RequestMessage("heavy", list(range(100, 400)), heavy))
    done = threading.Event()
    steps = []

    def decode():
        try:
            while worker.has_work():
                steps.append(worker.step())
                worker.poll_outputs(0)
        finally:
            done.set()

    stepper = _in_thread(decode)
    latencies, admitted = [], 0
    for i in range(100_000):
        if done.is_set():
            break
        start = time.monotonic()
        admitted += _reserve(worker, f"r{i}", prompt_len=8)  # one block; False: no room
        latencies.append(time.monotonic() - start)
        worker.abort(f"r{i}")
        time.sleep(0.02)
    stepper.join(WAIT_S)
    assert sum(steps) >= 8 and len(latencies) >= 20  # the choices decoded; reservations came throughout
    assert admitted >= 0.9 * len(latencies)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 1.0, f"reserve() p99 {p99:.3f} s over {len(latencies)} while 128 choices decoded"
    worker.step()
    engine.kv.assert_no_leaks()
