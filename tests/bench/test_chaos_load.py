"""bench/chaos_load.py judges each request by how its stream ended: a tiny HTTP server plays a
gateway that streams the reference, a wrong text, a truncated or cut stream, a stall or an error,
or answers without streaming, and every case must be judged as bench/chaos.py's invariants say;
a cut is excused only where the run SIGKILLed the gateway meanwhile. And the CLI refuses what
cannot work."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import chaos
from bench.chaos_load import KINDS, LONG_TOKENS, MAX_TOKENS, PROMPTS, Load

REFERENCE = " Paris. It is"
REFERENCES = {(k, p, m): REFERENCE for k in KINDS for p in PROMPTS for m in (*MAX_TOKENS, LONG_TOKENS)}


class _Gateway(BaseHTTPRequestHandler):
    mode = "reference"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.mode == "status":
            return self._reply(503, b'{"error": {"message": "not ready"}}')
        if not body["stream"]:
            return self._whole(body)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if self.mode == "cut":  # a body announced and never completed: the connection closes under it
            self.send_header("content-length", "100000")
        self.end_headers()
        chat = "messages" in body
        for i in range(body["n"]):
            text = {"wrong": " Lyon.", "slow_wrong": " Lyon.", "error": None}.get(self.mode, REFERENCE)
            if self.mode == "error":
                self._event({"error": {"message": "decode instance lost"}})
                return
            self._event(self._choice(i, text, None, chat))
            if self.mode in ("stall", "cut"):
                time.sleep(3 if self.mode == "stall" else 0)
                return
            if self.mode.startswith("slow"):
                for _ in range(4):
                    time.sleep(1.0)
                    self._event(self._choice(i, "", None, chat))
            if self.mode != "truncated":
                self._event(self._choice(i, "", "length", chat))
        self.wfile.write(b"data: [DONE]\n\n")

    @staticmethod
    def _choice(i: int, text: str, finish, chat: bool) -> dict:
        piece = {"delta": {"content": text}} if chat else {"text": text}
        return {"choices": [{"index": i, **piece, "finish_reason": finish}]}

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _whole(self, body: dict) -> None:
        """A non-streamed answer (after 3 s in the stall mode)."""
        time.sleep(3 if self.mode == "stall" else 0)
        text = " Lyon." if self.mode == "wrong" else REFERENCE
        piece = (lambda: {"message": {"role": "assistant", "content": text}}) if "messages" in body else (
            lambda: {"text": text})
        choices = [{"index": i, **piece(), "finish_reason": "length"} for i in range(body["n"])]
        self._reply(200, json.dumps({"choices": choices}).encode())

    def _reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("mode, outcome", [("reference", "ok"), ("wrong", "wrong_output"), ("truncated", "truncated"),
                                           ("stall", "hang"), ("slow", "late"), ("error", "error"),
                                           ("status", "error"), ("cut", "cut")])
def test_each_ending_is_judged(gateway, mode, outcome):
    """Stall: no byte for longer than the deadline. Slow: a byte every second, 4 s in all, past a
    3 s deadline that no single wait reaches."""
    _Gateway.mode = mode
    deadline = {"stall": 1.0, "slow": 3.0}.get(mode, 30.0)
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=2, seed=0, deadline_s=deadline, abort_fraction=0.0,
                n_fraction=0.5, plain_fraction=0.0).start()
    time.sleep(1.5)
    assert load.stop(timeout=20) == []
    ended = [r for r in load.records if r.outcome is not None]
    assert ended and {r.outcome for r in ended} == {outcome}, [(r.outcome, r.detail) for r in ended[:3]]
    if mode == "reference":  # many requests: both kinds, n = 1 and 2, each choice judged
        assert {r.kind for r in ended} == set(KINDS) and {r.n for r in ended} == {1, 2}


def test_aborted_requests_are_not_judged(gateway):
    """A client hangs up after 1-6 chunks: the slow stream has 6 per choice, ending with a wrong one."""
    _Gateway.mode = "slow_wrong"
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=1, seed=0, deadline_s=5.0, abort_fraction=1.0)
    load.start()
    time.sleep(0.3)
    load.stop(timeout=20)
    assert {r.outcome for r in load.records if r.outcome} == {"aborted"}


@pytest.mark.parametrize("mode, outcome", [("reference", "ok"), ("wrong", "wrong_output"), ("stall", "hang")])
def test_requests_not_streamed_are_judged_whole(gateway, mode, outcome):
    """A non-streamed answer is judged like a stream's end; no byte within the deadline is a hang."""
    _Gateway.mode = mode
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=2, seed=0, deadline_s=1.0 if mode == "stall" else 30.0,
                abort_fraction=0.0, n_fraction=0.5, plain_fraction=1.0).start()
    time.sleep(1.5)
    assert load.stop(timeout=20) == []
    ended = [r for r in load.records if r.outcome is not None]
    assert ended and {r.outcome for r in ended} == {outcome} and not any(r.stream for r in ended)


def test_a_client_that_hangs_up_a_request_not_streamed_aborts_it(gateway):
    """Its patience (0.5-2.5 s) runs out before the 3 s answer: aborted, not a hang."""
    _Gateway.mode = "stall"
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=1, seed=0, deadline_s=30.0, abort_fraction=1.0,
                plain_fraction=1.0).start()
    time.sleep(0.3)
    load.stop(timeout=20)
    assert {r.outcome for r in load.records if r.outcome} == {"aborted"}
    assert all(r.hangup_after_s is not None for r in load.records)


def test_a_cut_is_excused_only_when_its_gateway_was_sigkilled_meanwhile(gateway):
    """The run turns a cut into an explicit error when the request's own gateway was SIGKILLed
    between its start and its end; any other cut stays a violation."""
    from types import SimpleNamespace
    _Gateway.mode = "cut"
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=1, seed=0, deadline_s=30.0, abort_fraction=0.0,
                plain_fraction=0.0).start()
    time.sleep(0.3)
    load.stop(timeout=20)
    cuts = [r for r in load.records if r.outcome == "cut"]
    assert len(cuts) >= 2, [(r.outcome, r.detail) for r in load.records]
    run = chaos.Chaos.__new__(chaos.Chaos)
    run.injector = SimpleNamespace(sigkills=[("gw", cuts[0].sent_at), ("other-gw", cuts[1].sent_at)])
    run._excuse_cuts(load)
    assert cuts[0].outcome == "error" and "SIGKILLed" in cuts[0].detail and cuts[1].outcome == "cut"


@pytest.mark.parametrize("argv, message", [(["--duration", "0"], "--duration must be positive"),
                                           (["--dur", "5"], "unrecognized arguments"),
                                           (["--faults", "kill_head"], "invalid choice: 'kill_head'"),
                                           (["--concurrency", "0"], "--concurrency must be at least 1")])
def test_cli_refuses_what_cannot_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        chaos.parse_args(argv)
    assert message in capsys.readouterr().err
