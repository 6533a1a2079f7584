"""Cross-instance fetch through the router (issue 51 item 3, router/fetch.py): a prompt prefix
cached on prefill instance A, the request routed to prefill instance B (round robin: the router
follows the prefill instances' caches for fetches alone): B fetches the prefix's KV from A instead of
computing it, and the tokens equal transformers'; the next turn, on A, fetches the conversation with
its output from the decode instance; with --no-kv-fetch B computes it. In-process 2P1D."""
from __future__ import annotations

import time

import pytest

from cluster.control.cluster import Cluster
from engine.core.request import SamplingParams
from tests.cluster.control.test_inprocess_pd import spec_for
from tests.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("kv_fetch", [True, False], ids=["fetch", "no-kv-fetch"])
def test_a_prefix_cached_on_a_is_fetched_by_b_not_computed(tiny_path, kv_fetch):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype="float32")
    first = random_prompts(1, [40], seed=11)[0]
    second = first + random_prompts(1, [13], seed=12)[0]
    spec = spec_for(tiny_path, num_prefill=2, num_decode=1, router_policy="round_robin", kv_fetch=kv_fetch)
    with Cluster(spec, use_ray=False) as cluster:
        router = cluster.router
        prefills = {iid: i for iid, i in cluster.instances.items() if i.role == "prefill"}
        workers = {iid: i.ranks[0].worker for iid, i in prefills.items()}
        (s1,) = cluster.generate([first], GREEDY, timeout_s=60)
        assert s1.error is None and s1.token_ids == hf_greedy(hf, first, 6)
        a = next(iid for iid, w in workers.items() if w.num_computed_tokens)
        b = next(iid for iid in workers if iid != a)
        if kv_fetch:
            _wait(lambda: router.fetches.index.longest_prefix(first, [prefills[a].client.info])[a] == 5,
                  "the router's index to learn A's blocks")
        else:
            time.sleep(0.3)  # (the load thread's polls: an index followed would have learnt them)
            assert router.fetches.index.num_snapshots == 0  # --no-kv-fetch follows nothing
        (s2,) = cluster.generate([second], GREEDY, timeout_s=60)
        assert s2.error is None and s2.token_ids == hf_greedy(hf, second, 6)
        wb = workers[b]
        if not kv_fetch:
            assert wb.num_fetches == 0 and wb.num_computed_tokens == len(second)
            assert router.snapshot()["kv_fetches_chosen"] == 0
            return
        assert (wb.num_fetches, wb.num_fetched_tokens, wb.num_fetches_failed) == (1, 40, 0)
        assert wb.num_computed_tokens == len(second) - 40  # B computed only what A did not hold
        assert workers[a].num_computed_tokens == len(first)  # A computed nothing more: it shipped
        stats = router.snapshot()
        assert (stats["kv_fetches_chosen"], stats["kv_fetches_opened"], stats["kv_fetches_refused"]) == (1, 1, 0)

        # the third turn goes to A, which holds the first; the decode instance holds the second with
        # its output (7 blocks), more than B (the second's 6): A fetches from the decode instance
        third = second + s2.token_ids + random_prompts(1, [9], seed=13)[0]
        decode = next(i for i in cluster.instances.values() if i.role == "decode")
        _wait(lambda: router.fetches.index.longest_prefix(third, [decode.client.info])[decode.instance_id] == 7,
              "the router's index to learn the decode instance's blocks")
        wa, computed = workers[a], workers[a].num_computed_tokens
        (s3,) = cluster.generate([third], GREEDY, timeout_s=60)
        assert s3.error is None and s3.token_ids == hf_greedy(hf, third, 6)
        assert (wa.num_fetches, wa.num_fetched_tokens) == (1, 56 - 40)  # A held the first 40 itself
        assert wa.num_computed_tokens - computed == len(third) - 56
        _wait(lambda: decode.ranks[0].worker.kv.usage == 0 and wa.kv.usage == 0, "the held blocks freed")
        cluster.assert_no_leaks()
