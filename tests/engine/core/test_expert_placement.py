"""Expert placement (engine/core/expert_placement.py): the default runs, the load-balancing plan with
and without replicas, its validity on random loads, and the file format's refusals."""
from __future__ import annotations

import random

import pytest
import torch

from engine.core.expert_placement import ExpertPlacement, imbalance, pack, plan, rank_loads
from engine.layers.expert_compute import LocalExperts
from engine.layers.moe import grouped_experts, route

SKEWED = [400, 200, 120, 90, 60, 40, 20, 10]  # tokens per expert: the hot ones share the first rank by default


def test_plan_lowers_the_rank_imbalance_of_a_skewed_routing():
    """Contiguous runs put experts 0-3 (810 of 940 tokens) on rank 0: imbalance 1.72. The plan
    balances the ranks without replicas, and does better with two (the 400-token expert split)."""
    default = ExpertPlacement.contiguous(8, 2, [0])
    before = imbalance(rank_loads(SKEWED, default.layers[0]))
    after = imbalance(rank_loads(SKEWED, plan({0: SKEWED}, 2).layers[0]))
    replicated = plan({0: SKEWED}, 2, num_replicas=2)
    with_replicas = imbalance(rank_loads(SKEWED, replicated.layers[0]))
    assert before == pytest.approx(1.7234, abs=1e-4)
    assert after < 1.1 and with_replicas <= after and with_replicas < 1.02, (after, with_replicas)
    assert replicated.holders(0)[0] == (0, 1)  # the hottest expert is on both ranks
    assert [len(r) for r in replicated.layers[0]] == [5, 5]


@pytest.mark.parametrize("seed", range(40))
def test_every_plan_is_a_valid_placement(seed):
    """On random loads, ranks and replica counts: every expert on at least one rank, never twice on
    one, every rank the same number of slots, copies on distinct ranks (the plan's swap when the
    ranks left with free slots already hold the expert)."""
    rng = random.Random(seed)
    num_ranks = rng.choice([2, 3, 4])
    num_experts = num_ranks * rng.randint(1, 4)
    num_replicas = num_ranks * rng.randint(0, 2)
    num_replicas = min(num_replicas, num_experts * (num_ranks - 1))
    counts = {layer: [int(rng.paretovariate(1.2) * 10) for _ in range(num_experts)] for layer in (1, 3)}
    placement = plan(counts, num_ranks, num_replicas)
    assert placement.misfit(num_experts, [1, 3], num_ranks) is None
    for layer in (1, 3):
        assert {len(r) for r in placement.layers[layer]} == {(num_experts + num_replicas) // num_ranks}


def test_packing_swaps_when_the_free_ranks_already_hold_the_expert():
    """Expert 0 (10 tokens) fills rank 0's load, experts 1-3 fill rank 1's slots; the two copies
    of expert 4 then find only rank 0 free for the second: rank 1 hands expert 1 over and takes it."""
    held = pack([0, 1, 2, 3, 4, 4], [10, 3, 3, 3, 1], num_ranks=2, slots=3)
    assert held == [[0, 4, 1], [2, 3, 4]]


def test_plan_refuses_replicas_that_do_not_fill_the_ranks():
    with pytest.raises(ValueError, match="8 experts \\+ 1 replicas do not fill 2 ranks evenly"):
        plan({0: SKEWED}, 2, num_replicas=1)


def test_replicas_split_their_tokens_and_the_ranks_sum_to_the_whole():
    """Expert 0 on both ranks: each computes the tokens whose index is its own mod 2; the two
    partial sums add up to the sum over all experts held once."""
    g = torch.Generator().manual_seed(0)
    router, w13 = torch.randn(4, 8, generator=g), torch.randn(4, 16, 8, generator=g)
    w2 = torch.randn(4, 8, 8, generator=g)
    x = torch.randn(15, 8, generator=g)
    weights, ids = route(x @ router.T, 2, True)
    placement = ExpertPlacement(2, {0: ((0, 1, 2), (0, 3))})
    parts = []
    for rank in range(2):
        held = placement.held(0, rank)
        local = LocalExperts.of(held, 4)
        parts.append(grouped_experts(x, w13[list(held.ids)], w2[list(held.ids)], weights, ids, local, "grouped_mm"))
    torch.testing.assert_close(parts[0] + parts[1], grouped_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement,why", [
    (ExpertPlacement(2, {0: ((0, 1), (2,))}), "layer 0: experts [3] on no rank"),
    (ExpertPlacement(2, {0: ((0, 1), (2, 3, 4))}), "layer 0: experts [4] do not exist"),
    (ExpertPlacement(3, {0: ((0,), (1, 2), (3,))}), "it places experts on 3 ranks, the instance has 2"),
    (ExpertPlacement(2, {1: ((0, 1), (2, 3))}), "it places layers [1], the model's sparse layers are [0]"),
])
def test_a_placement_that_cannot_run_says_why(placement, why):
    assert placement.misfit(4, [0], 2) == why


def test_the_file_round_trips_and_garbage_is_refused_by_name(tmp_path):
    placement = plan({0: SKEWED, 2: SKEWED[::-1]}, 2, num_replicas=2)
    path = tmp_path / "p.json"
    path.write_text(placement.to_json())
    assert ExpertPlacement.from_file(path) == placement
    path.write_text('{"num_ranks": 2}')
    with pytest.raises(ValueError, match=f"^{path}: not an expert placement \\(KeyError"):
        ExpertPlacement.from_file(path)
    with pytest.raises(ValueError, match="no such file"):
        ExpertPlacement.from_file(tmp_path / "missing.json")
