"""A prefill instance ships KV it holds for another instance's fetch (PrefillWorker.ship_held,
issue 51 item 3): the blocks of a prompt its prefix cache holds leave, every layer, from the first
token the fetcher lacks, with no forward pass; they stay pinned until the transfer ends; a prefix it
does not hold whole is refused (ship_held says why), nothing shipped; blocks its host tier took are
reloaded first, those its disk tier took read first."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from engine.core.block_manager import block_hashes
from engine.core.request import RequestMessage
from engine.runner.model_runner import ModelRunner
from kvtransfer.base import KVSender, Transfer
from kvtransfer.connector import PrefillConnector
from kvtransfer.params import KVEndpoint, KVTransferParams
from prefill_worker.worker import PrefillWorker
from tests.helpers import engine_config, make_hf_tiny_llama, model_config_of
from tests.kvtransfer.test_connector import PARAMS, ScriptedSender, prefill_worker, run_until

PROMPT = list(range(3, 27))  # 24 tokens: 3 blocks of 8


class KeepingTransfer(Transfer):
    """Keeps every layer it is given."""

    def __init__(self):
        self.layers, self.finished = {}, None

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        self.layers[layer] = kv.clone()

    def finish(self, trailer: bytes = b"") -> None:
        self.finished = trailer

    def wait(self, timeout: float | None = None) -> None:
        pass


class KeepingSender(KVSender):
    def __init__(self):
        self.transfers = []

    def begin(self, request_id, dest, head_start, head_end, num_tokens, slots=None, trace="") -> Transfer:
        t = KeepingTransfer()
        self.transfers.append((request_id, dest.rank, num_tokens, t))
        return t

    stats = {}
    transfer_seconds = 0.0

    def close(self) -> None:
        pass


def params(rid: str, start: int) -> KVTransferParams:
    return KVTransferParams(rid, "f", 1, (KVEndpoint("f", 0, "h", 1),), decode_cached_tokens=start)


def _ship(worker, tokens: list[int], p: KVTransferParams) -> str | None:
    """ship_held's answer, the worker stepped meanwhile (its loop takes the request)."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(worker.ship_held(p.request_id, tokens, p, wait_s=10)))
    thread.start()
    while thread.is_alive():
        worker.step()
        thread.join(0.001)
    return answer[0]


@pytest.fixture
def holder():
    """A prefill worker that computed PROMPT + one token (its 3 full blocks cached) and shipped it."""
    worker, _ = prefill_worker("ack")
    worker.submit(RequestMessage("r", PROMPT + [9], PARAMS), params("r", 0))
    (first,) = run_until(worker, 1)
    assert first.error is None
    deadline = time.monotonic() + 10
    while worker.kv.usage > 0 and time.monotonic() < deadline:  # delivered: blocks back in the cache
        worker.step()
    worker.connector.sender = sender = KeepingSender()
    return worker, sender


def test_held_blocks_leave_from_the_first_token_the_fetcher_lacks_without_a_forward(holder):
    worker, sender = holder
    computed = worker.num_computed_tokens
    _ship(worker, PROMPT, params("f", 8))
    deadline = time.monotonic() + 10
    while not sender.transfers and time.monotonic() < deadline:
        worker.step()
    assert worker.num_computed_tokens == computed  # nothing computed
    (rid, rank, n, t), = sender.transfers
    mc, kv = worker.runner.model_config, worker.runner.kv_cache
    assert (rid, rank, n, t.finished) == ("f", 0, 16, b"") and sorted(t.layers) == list(range(mc.num_layers))
    blocks = [worker.kv.block_pool.get_cached_block(h).block_id for h in block_hashes(PROMPT, 8)]
    for layer, got in t.layers.items():  # (2, tokens, heads, head_dim): tokens 8..23 of the held blocks
        want = torch.cat([kv[layer][:, b] for b in blocks[1:]], dim=1)
        assert torch.equal(got, want), layer
    deadline = time.monotonic() + 10
    while worker.kv.usage > 0 and time.monotonic() < deadline:
        worker.step()
    worker.kv.assert_no_leaks()
    assert worker.poll_outputs(0.01) == []  # nothing for the router: the fetcher sees the KV arrive


def test_a_salted_prefix_ships_under_its_salt_only():
    """A prompt computed under salt "t1": a fetch of it under "t1" ships its blocks; unsalted, or
    under another salt, the holder holds none of it (refused, nothing leaves)."""
    worker, _ = prefill_worker("ack")
    worker.submit(RequestMessage("r", PROMPT + [9], replace(PARAMS, cache_salt="t1")), params("r", 0))
    (first,) = run_until(worker, 1)
    deadline = time.monotonic() + 10
    while worker.kv.usage > 0 and time.monotonic() < deadline:
        worker.step()
    worker.connector.sender = sender = KeepingSender()
    for salt in (None, "t2"):
        answer = _ship(worker, PROMPT, replace(params(f"f-{salt}", 8), cache_salt=salt))
        assert answer is not None and "holds fewer" in answer, (salt, answer)
    assert sender.transfers == []
    assert _ship(worker, PROMPT, replace(params("f", 8), cache_salt="t1")) is None
    while not sender.transfers and time.monotonic() < deadline:
        worker.step()
    assert [(rid, n) for rid, _, n, _ in sender.transfers] == [("f", 16)]


@pytest.mark.parametrize("tokens,start,why", [(PROMPT[:8] + [1] * 8, 0, "holds fewer than its 2 blocks"),
                                              (PROMPT[:20], 0, "not whole blocks"),
                                              (PROMPT, 24, "not whole blocks")])
def test_a_prefix_not_held_whole_is_refused_and_nothing_leaves(holder, tokens, start, why):
    worker, sender = holder
    answer = _ship(worker, tokens, params("f", start))
    assert answer is not None and why in answer
    worker.step()
    assert sender.transfers == [] and worker.kv.usage == 0


def test_blocks_the_host_tier_took_are_reloaded_and_shipped():
    """The holder's pool evicted the prefix into its host tier: ship_held reloads those blocks into
    blocks of its own (the copies made by the step that ships) and ships the KV computed at first."""
    hf = make_hf_tiny_llama()
    runner = ModelRunner(engine_config(num_blocks=12, block_size=8, host_tier_gib=0.01), model_config=model_config_of(hf),
                         weights=hf.state_dict().items())
    worker = PrefillWorker(runner, PrefillConnector(ScriptedSender("ack"), runner.model_config.num_kv_heads, 0, 1, 5.0))
    assert worker.kv.tier is not None
    want = evicted_prefix(worker)
    sender = shipped(worker)
    (rid, _, n, t), = sender.transfers
    assert (rid, n) == ("f", 24) and worker.kv.tier.stats["reloaded_blocks"] >= 3
    for layer, got in t.layers.items():
        assert torch.equal(got, want[layer]), layer
    settle(worker)


def test_blocks_the_disk_tier_took_are_read_then_reloaded_and_shipped(tmp_path):
    """A host tier of 2 slots over a disk tier: the prefix's blocks leave for disk; ship_held says
    at once that it holds them, every rank reads them while the worker steps, and the shipment
    follows: the KV computed at first."""
    hf = make_hf_tiny_llama()
    hf.save_pretrained(tmp_path / "tiny")
    c = hf.config
    block_bytes = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 8 * 4
    cfg = engine_config(model=str(tmp_path / "tiny"), num_blocks=12, block_size=8, host_tier_gib=2.5 * block_bytes / 2**30,
                        disk_tier_gib=0.01, disk_tier_dir=str(tmp_path / "kv"))
    runner = ModelRunner(cfg)
    worker = PrefillWorker(runner, PrefillConnector(ScriptedSender("ack"), runner.model_config.num_kv_heads, 0, 1, 5.0))
    assert worker.kv.tier.disk is not None and runner.host_arena.num_slots == 2
    want = evicted_prefix(worker)
    assert all(worker.kv.tier.disk.has(h) and h not in worker.kv.tier._slots for h in block_hashes(PROMPT, 8))
    sender = shipped(worker)
    (rid, _, n, t), = sender.transfers
    assert (rid, n) == ("f", 24) and worker.kv.tier.disk.stats["loaded_blocks"] >= 3
    for layer, got in t.layers.items():
        assert torch.equal(got, want[layer]), layer
    settle(worker)


def settle(worker) -> None:
    """Steps until the transfers ended and their blocks are back in the cache; no leak."""
    deadline = time.monotonic() + 10
    while worker.kv.usage > 0 and time.monotonic() < deadline:
        worker.step()
    worker.kv.assert_no_leaks()


def evicted_prefix(worker) -> list[torch.Tensor]:
    """PROMPT computed, then other prompts push its blocks out of the pool (5 blocks each, 11 usable);
    per layer, PROMPT's KV as computed."""
    def compute(rid: str, tokens: list[int]) -> None:
        worker.submit(RequestMessage(rid, tokens, PARAMS), params(rid, 0))
        assert run_until(worker, 1)[0].error is None
        settle(worker)

    hashes = block_hashes(PROMPT, 8)
    compute("r", PROMPT + [9])
    kv = worker.runner.kv_cache
    want = [torch.cat([kv[layer][:, worker.kv.block_pool.get_cached_block(h).block_id] for h in hashes], dim=1)
            for layer in range(worker.runner.model_config.num_layers)]
    for i in range(3):
        compute(f"other{i}", [200 + i] * 33)
    assert all(worker.kv.block_pool.get_cached_block(h) is None for h in hashes)
    return want


def shipped(worker) -> KeepingSender:
    """ship_held of PROMPT, answered at once (held), stepped until its transfer began."""
    worker.connector.sender = sender = KeepingSender()
    assert _ship(worker, PROMPT, params("f", 0)) is None
    deadline = time.monotonic() + 10
    while not sender.transfers and time.monotonic() < deadline:
        worker.step()
    return sender
