"""A prefill instance fetches a prompt prefix another instance holds (issue 51 item 3): B.fetch
allocates the prompt and expects the prefix's KV, A.ship_held sends it from its cache, B computes
only the rest and ships the prompt to the decode instance; the tokens equal transformers'. When the
holder refuses, B computes the whole prompt: the same tokens, the fetch counted failed. The decode
instance D is a holder too: a conversation's next turn fetches the last turn's prompt and output
from D's pool (no prefill instance holds the output).

Real ranks (RankHost: model, KV sender and receiver, step loop) over the torch transport (gloo)."""
from __future__ import annotations

import time

import pytest

from cluster.ranks.rank import RankHost
from cluster.spec import ClusterSpec
from engine.core.block_manager import block_hashes
from engine.core.request import RequestMessage, SamplingParams
from kvtransfer.params import KVTransferParams
from tests.helpers import hf_greedy, random_prompts, save_tiny_llama

pytestmark = pytest.mark.timeout(180)

BLOCK, MAX_TOKENS = 8, 6


def _host(path: str, role: str, iid: str) -> RankHost:
    config = ClusterSpec(model=path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=BLOCK,
                         max_num_seqs=4, max_num_batched_tokens=64, num_threads=1,
                         mode="disaggregated").engine_config(role)
    return RankHost(config, role, iid, kv_timeout_s=10.0, kv_same_device=False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def hosts(tiny_path):
    built = {iid: _host(tiny_path, role, iid) for iid, role in (("a", "prefill"), ("b", "prefill"), ("d", "decode"))}
    yield built
    for h in built.values():
        h.shutdown()


def _wait(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := predicate()):
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _results(worker, rid: str) -> list:
    return [r for r in worker.poll_outputs(0.05) if r.request_id == rid]


def _generate(hosts, rid: str, prompt: list[int], fetch_from: str | None = None, held: int = 0,
              max_tokens: int = MAX_TOKENS) -> list[int]:
    """The router's part, by hand: D reserves, the prompt goes to B (fetching its first `held`
    tokens from `fetch_from`) or to A; returns the prefill's first token and D's tokens after it."""
    d = hosts["d"]
    msg = RequestMessage(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    reservation = d.worker.reserve(msg, 1)
    params = KVTransferParams(rid, "d", 1, (d.kv_endpoint(),), decode_cached_tokens=reservation.cached_tokens)
    prefill = hosts["a"].worker if fetch_from is None else hosts["b"].worker
    if fetch_from is None:
        prefill.submit(msg, params)
    else:
        start = prefill.fetch(msg, params, held, 1)
        assert start == 0  # B holds nothing of it
        why = hosts[fetch_from].worker.ship_held(rid, prompt[:held], KVTransferParams(
            rid, "b", 1, (hosts["b"].kv_endpoint(),), decode_cached_tokens=start))
        if why is not None:
            assert "cannot ship the held prefix" in why
            prefill.give_up_fetch(rid)  # what the router does with the holder's refusal
    first, = _wait(lambda: _results(prefill, rid), f"{rid}'s first token")
    assert first.error is None, first.error
    tokens = [first.first_token]

    def finished():
        for out in d.worker.poll_outputs(0.05):
            assert out.error is None, out.error
            tokens.extend(out.new_token_ids)
            if out.finished:
                return True
        return False
    _wait(finished, f"{rid}'s tokens")
    return tokens


def test_a_prefix_held_by_another_prefill_instance_is_fetched_not_computed(hosts, tiny_path):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype="float32")
    first, = random_prompts(1, [40], seed=5)
    second = first + random_prompts(1, [13], seed=6)[0]  # a second turn: the first turn's 5 blocks held by A
    assert _generate(hosts, "turn1", first) == hf_greedy(hf, first, MAX_TOKENS)
    a, b = hosts["a"].worker, hosts["b"].worker
    computed = b.num_computed_tokens
    assert _generate(hosts, "turn2", second, fetch_from="a", held=40) == hf_greedy(hf, second, MAX_TOKENS)
    assert (b.num_fetches, b.num_fetched_tokens, b.num_fetches_failed) == (1, 40, 0)
    assert b.num_computed_tokens - computed == len(second) - 40  # only what the holder did not send
    assert b.load()["kv_fetch_bytes_received"] > 0
    # B's prefix cache holds the fetched blocks now (a third turn on B would hit them)
    assert all(b.kv.block_pool.get_cached_block(h) is not None for h in block_hashes(second[:40], BLOCK))

    # the holder lacks the prefix: it refuses, B computes all of it, the same tokens
    other = random_prompts(1, [35], seed=7)[0]
    computed = b.num_computed_tokens
    assert _generate(hosts, "unheld", other, fetch_from="a", held=32) == hf_greedy(hf, other, MAX_TOKENS)
    assert (b.num_fetches, b.num_fetches_failed) == (1, 1)
    assert b.num_computed_tokens - computed == len(other)
    _wait(lambda: a.kv.usage == 0 and b.kv.usage == 0, "the prefill instances' blocks freed")


def test_the_decode_instance_ships_a_conversations_turn_outputs_included(hosts, tiny_path):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype="float32")
    first = random_prompts(1, [36], seed=21)[0]
    out = _generate(hosts, "conv1", first, max_tokens=14)  # D computes the KV of 36 + 13 tokens: 6 blocks
    assert out == hf_greedy(hf, first, 14)
    second = first + out + random_prompts(1, [5], seed=22)[0]
    b, d = hosts["b"].worker, hosts["d"].worker
    fetched, computed = b.num_fetched_tokens, b.num_computed_tokens
    assert _generate(hosts, "conv2", second, fetch_from="d", held=48) == hf_greedy(hf, second, MAX_TOKENS)
    assert b.num_fetched_tokens - fetched == 48 and b.num_computed_tokens - computed == len(second) - 48
    _wait(lambda: d.kv.usage == 0 and b.kv.usage == 0, "the held and fetched blocks freed")
