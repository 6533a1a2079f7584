"""A cluster stand-in for gateway tests: answers every request at once with fixed tokens, so
the HTTP layer (validation, formats, errors) is tested without a model."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from router.stream import StreamEvent

TOKENS = [504, 3575, 282, 4649, 314, 7042, 30]  # "The capital of France is Paris."


class FakeCluster:
    max_model_len = 256

    def __init__(self):
        self.instances, self.aborted, self.submitted = {}, [], []
        self.router = SimpleNamespace(_pending=[], _by_attempt={})
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    def submit(self, request_id, prompt_token_ids, params, listener=None):
        self.submitted.append((request_id, prompt_token_ids, params))
        n = min(params.max_tokens, len(TOKENS))

        def emit():
            for t in TOKENS[:n]:
                listener(StreamEvent([t]))
            listener(StreamEvent([], True, "length" if n == params.max_tokens else "stop"))
        threading.Thread(target=emit, daemon=True).start()

    def abort(self, request_id):
        self.aborted.append(request_id)
