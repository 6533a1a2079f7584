"""DeepSeek's routings (engine/layers/routing.py) against transformers' routers on the same weights: the
same experts and weights per token (order aside), for V2's greedy and group-limited choices and
V3's sigmoid choice with the correction bias, over groups."""
from __future__ import annotations

import pytest
import torch

from engine.core.config import MoEConfig
from engine.layers.routing import route_tokens, top_ids

EXPERTS, HIDDEN = 16, 24


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("method,groups", [("greedy", 1), ("group_limited_greedy", 4), ("noaux_tc", 4),
                                           ("noaux_tc", 1)])
def test_deepseek_routing_equals_transformers(method, groups):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=groups,
                  topk_group=2 if groups > 1 else 1, routed_scaling_factor=2.5)
    if method == "noaux_tc":
        ref = DeepseekV3TopkRouter(DeepseekV3Config(**common, norm_topk_prob=True))
        ref.e_score_correction_bias.normal_(0, 0.3)
        routing, renormalize = "noaux_tc", True
    else:
        ref = DeepseekV2TopkRouter(DeepseekV2Config(**common, topk_method=method))
        routing, renormalize = ("softmax" if method == "greedy" else method), False
    ref.weight.data.normal_(0, 1.0)
    moe = MoEConfig(num_experts=EXPERTS, top_k=3, intermediate_size=8, renormalize=renormalize, routing=routing,
                    num_groups=groups, topk_groups=2 if groups > 1 else 1, routed_scaling_factor=2.5,
                    shared_expert_gate=False)
    x = torch.randn(200, HIDDEN)
    with torch.no_grad():
        logits, want_weights, want_ids = ref(x)
    bias = getattr(ref, "e_score_correction_bias", None)
    got = _sorted(*route_tokens(logits, moe, bias))
    want = _sorted(want_weights, want_ids)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


def test_groups_out_of_the_top_groups_are_never_chosen():
    """noaux_tc: an expert with the best score of all but in a group whose two best sum low is not
    chosen; ties among groups and experts go to the lower index."""
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=8, renormalize=True, routing="noaux_tc",
                    num_groups=4, topk_groups=1, shared_expert_gate=False)
    logits = torch.full((1, 8), -4.0)
    logits[0, 7] = 6.0  # group 3's best, its other expert low
    logits[0, 0] = logits[0, 1] = 2.0  # group 0: two good ones, the best pair
    weights, ids = route_tokens(logits, moe)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights, torch.tensor([[0.5, 0.5]]))
    assert top_ids(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 2).tolist() == [[1, 2]]
