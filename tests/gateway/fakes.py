"""A cluster stand-in for gateway tests: answers every request at once with fixed tokens, so
the HTTP layer (validation, formats, errors) is tested without a model."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from router.tables import STATS, StreamEvent

TOKENS = [504, 3575, 282, 4649, 314, 7042, 30]  # "The capital of France is Paris."


def fake_logprobs(i: int, token: int, top_n: int) -> dict[int, float]:
    """Sampled token first; it is the most likely on even positions, below the top n on odd ones."""
    return {token: -0.25 if i % 2 == 0 else -9.0, **{1000 + k: -1.0 - k for k in range(top_n)}}


class FakeCluster:
    max_model_len = 256

    def __init__(self):
        self.instances, self.aborted, self.submitted, self.stopped, self.sessions = {}, [], [], [], []
        self.router = SimpleNamespace(num_queued=0, num_placed=0, stats={  # every counter a router keeps
            **dict.fromkeys(STATS, 0), "retries": 2, "failed": 1, "instance_deaths": 1, "tokens_past_stop": 0,
            "kv_recomputes": 3, "prompt_tokens": 100, "cached_prompt_tokens": 64,
            "session_placements": 5, "prefix_available_tokens": 80, "prefix_routed_tokens": 72})
        self.is_ready = True
        self.status_rows: list[dict] = []  # what instance_status gives /status
        self.cached_tokens = 0  # what each choice's first event says the prefix cache served

    # -- the view (router/view.py), empty unless a test fills it ------------------------------------
    def instance_infos(self) -> list:
        return []

    def instance_status(self) -> list[dict]:
        return list(self.status_rows)

    def ready(self) -> bool:
        return self.is_ready

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.submitted.append((request_id, prompt_token_ids, params))
        self.sessions.append(session)
        n = min(params.max_tokens, len(TOKENS))

        def emit():  # each choice the same tokens (the events of n > 1 choices interleave)
            for i, t in enumerate(TOKENS[:n]):
                for c in range(params.n):
                    extras = None if params.logprobs is None else [{"logprobs": fake_logprobs(i, t, params.logprobs)}]
                    listener(StreamEvent([t], extras=extras, index=c,
                                         num_cached_tokens=self.cached_tokens if i == 0 else None))
            for c in range(params.n):
                listener(StreamEvent([], True, "length" if n == params.max_tokens else "stop", index=c))
        threading.Thread(target=emit, daemon=True).start()

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stop(self, request_id, index, num_tokens):
        self.stopped.append((request_id, index, num_tokens))
