"""bench/chaos_load.py judges each request by how its stream ended: a tiny HTTP server plays a
gateway that streams the reference, a wrong text, a cut stream, a stall or an error, and every
case must be judged as bench/chaos.py's invariants say. And the CLI refuses what cannot work."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import chaos
from bench.chaos_load import KINDS, MAX_TOKENS, PROMPTS, Load

REFERENCE = " Paris. It is"
REFERENCES = {(k, p, m): REFERENCE for k in KINDS for p in PROMPTS for m in MAX_TOKENS}


class _Gateway(BaseHTTPRequestHandler):
    mode = "reference"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.mode == "status":
            return self._reply(503, b'{"error": {"message": "not ready"}}')
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        for i in range(body["n"]):
            text = {"wrong": " Lyon.", "slow_wrong": " Lyon.", "error": None}.get(self.mode, REFERENCE)
            if self.mode == "error":
                self._event({"error": {"message": "decode instance lost"}})
                return
            self._event(self._choice(i, text, None, chat))
            if self.mode == "stall":
                time.sleep(3)
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
                                           ("status", "error")])
def test_each_ending_is_judged(gateway, mode, outcome):
    """Stall: no byte for longer than the deadline. Slow: a byte every second, 4 s in all, past a
    3 s deadline that no single wait reaches."""
    _Gateway.mode = mode
    deadline = {"stall": 1.0, "slow": 3.0}.get(mode, 30.0)
    load = Load(lambda: {"gw": gateway}, REFERENCES, concurrency=2, seed=0, deadline_s=deadline, abort_fraction=0.0,
                n_fraction=0.5).start()
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


@pytest.mark.parametrize("argv, message", [(["--duration", "0"], "--duration must be positive"),
                                           (["--dur", "5"], "unrecognized arguments"),
                                           (["--faults", "kill_head"], "invalid choice: 'kill_head'"),
                                           (["--concurrency", "0"], "--concurrency must be at least 1")])
def test_cli_refuses_what_cannot_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        chaos.parse_args(argv)
    assert message in capsys.readouterr().err
