"""Delta transfer with sliding windows (Gemma 2: layers 0 and 2 see 24 tokens, layer 1 all): the
decode instance takes its cached blocks of a second turn only when every window of the new prompt
starts within them (the blocks between would never be written otherwise); then each layer ships
the tokens after them, else the window's cut as without a cache. Greedy tokens equal colocated."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.control.cluster import Cluster
from engine.loading.loader import hf_model_config
from engine.core.request import SamplingParams
from tests.cluster.control.test_inprocess_pd import spec_for
from tests.helpers import FAMILIES, random_prompts, save_tiny

pytestmark = pytest.mark.timeout(120)
TURN1 = random_prompts(1, [10], seed=31)[0]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def two_turns(spec, new: list[int], between: tuple = ()) -> tuple[list[list[int]], int, int, dict]:
    """Both turns' tokens, the decode instance's KV bytes received and tokens reused in the second,
    and its load figures after it; the prompts `between` served in between."""
    with Cluster(spec, use_ray=False) as cluster:
        (first,) = cluster.generate([TURN1], PARAMS, timeout_s=60)
        for prompt in between:
            assert cluster.generate([prompt], PARAMS, timeout_s=60)[0].error is None
        decode = cluster.instances["decode-0"].client if spec.mode == "disaggregated" else None
        before = decode.load() if decode else {}
        (second,) = cluster.generate([TURN1 + first.token_ids + new], PARAMS, timeout_s=60)
        after = decode.load() if decode else {}
        assert first.error is None and second.error is None, (first.error, second.error)
        cluster.assert_no_leaks()
    received = after.get("kv_bytes_received", 0) - before.get("kv_bytes_received", 0)
    return [first.token_ids, second.token_ids], received, after.get("kv_reused_prompt_tokens", 0), after


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    kind, switches = FAMILIES["gemma2"]
    assert switches["sliding_window"] == 24
    return str(save_tiny(tmp_path_factory.mktemp("delta") / "gemma2", kind, seed=3, **switches))


@pytest.mark.parametrize("new_len,held,shipped", [
    (5, 8, [11, 11, 11]),  # 19 tokens: every window starts at 0, within the 8 held: 11 ship per layer
    (40, 0, [23, 54, 23]),  # 54 tokens: the windows start at 31, past the 8 held: none taken
])
def test_the_decode_takes_its_cached_blocks_only_where_the_windows_start_within_them(gemma2, new_len, held, shipped):
    new = random_prompts(1, [new_len], seed=32)[0]
    want, *_ = two_turns(spec_for(gemma2, mode="colocated", attention_backend="torch"), new)
    mc = hf_model_config(Path(gemma2))
    per_token = 2 * mc.num_kv_heads * mc.head_dim * 4  # one layer's, fp32
    got, received, reused, _ = two_turns(spec_for(gemma2, attention_backend="torch"), new)
    assert got == want
    assert reused == held and received == sum(shipped) * per_token


def test_with_host_tiers_the_windowed_second_turn_comes_back_from_them(gemma2):
    """Pools of 25 blocks (3 KV groups): two 60-token prompts between the turns push the first
    turn's blocks of every group into the host tiers; the decode instance's reservation takes its
    block back from its tier (the windows start within it), the prefill instance reloads its own;
    the tokens equal colocated."""
    new = random_prompts(1, [5], seed=32)[0]
    between = tuple(random_prompts(2, [60], seed=33))
    want, *_ = two_turns(spec_for(gemma2, mode="colocated", attention_backend="torch"), new, between)
    got, _, reused, decode = two_turns(spec_for(gemma2, attention_backend="torch", num_kv_blocks=26,
                                                kv_host_tier_gib=0.01), new, between)
    assert got == want and reused == 8 and decode["kv_host_tier_reloaded_blocks"] >= 3, decode
