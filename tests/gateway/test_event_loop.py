"""The gateway never blocks its event loop on the cluster: while one request's submit waits on
a slow instance, other requests are served."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.app import create_app
from tests.gateway.fakes import FakeCluster

pytestmark = pytest.mark.timeout(60)


class SlowSubmitCluster(FakeCluster):
    """submit() blocks until released, like a router placing on an instance that does not answer."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.gave_up_waiting = False  # nobody released it: the event loop was stuck in here

    def submit(self, request_id, prompt_token_ids, params, listener=None, session=None, trace="", *tenant):
        self.entered.set()
        self.gave_up_waiting = not self.release.wait(5)
        super().submit(request_id, prompt_token_ids, params, listener)


async def _scenario(app, cluster: SlowSubmitCluster) -> tuple[int, int, bool]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        slow = asyncio.create_task(client.post("/v1/completions", json={
            "model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0}))
        while not cluster.entered.is_set():
            await asyncio.sleep(0.01)
        health = await asyncio.wait_for(client.get("/health"), 5)  # the loop is free meanwhile
        cluster.release.set()
        return health.status_code, (await asyncio.wait_for(slow, 10)).status_code, cluster.gave_up_waiting


def test_blocked_submit_leaves_event_loop_free():
    """/health answers while a completion's submit is blocked; the completion then succeeds."""
    cluster = SlowSubmitCluster()
    app = create_app(cluster, Tokenizer.from_path(resolve_model_path("smollm2")), "smollm2",
                     FakeCluster.max_model_len)
    assert asyncio.run(_scenario(app, cluster)) == (200, 200, False)
