"""Which experts each token goes to, and with what weights: a mixture's router (engine/layers/moe.py).

    weights, ids = route_tokens(router_logits, moe, correction_bias)   # (num_tokens, top_k) each

- "softmax" (Mixtral, Qwen-MoE, gpt-oss, DeepSeek-V2's "greedy"): the top-k of the softmax,
  rescaled to sum to 1 with `renormalize`.
- "group_limited_greedy" (DeepSeek-V2): the softmax, the experts split into `num_groups` groups,
  only the `topk_groups` groups with the highest best score eligible, then the top-k of those.
- "noaux_tc" (DeepSeek-V3, Kimi K2): sigmoid scores; experts are chosen on score plus the
  router's `e_score_correction_bias` (its load-balancing term), groups ranked by the sum of their
  two best such values; the weights are the chosen experts' plain scores.

Then the weights are renormalized where the config says (DeepSeek-V3 divides by the sum + 1e-20,
as its reference does) and multiplied by `routed_scaling_factor`. Equal values go to the lower
id (a stable sort), for groups as for experts: torch.topk's order among ties depends on the kernel.
"""
from __future__ import annotations

import torch

from engine.core.config import MoEConfig


def top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest values along the last axis, highest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Mixtral, Qwen2/3-MoE).

    Args:
        router_logits: (num_tokens, num_experts).
        renormalize: rescale the chosen probabilities to sum to 1 per token.

    Returns:
        weights (num_tokens, top_k) in float32 and expert ids (num_tokens, top_k), highest first.
        Equal probabilities go to the lower expert id: a stable sort, where torch.topk's order
        among ties depends on the kernel (measured: a CPU's took experts 3 and 5 of 6 tied ones).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k].contiguous(), ids[:, :top_k].contiguous()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_tokens(router_logits: torch.Tensor, moe: MoEConfig,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's routing (module docstring): weights (num_tokens, top_k) float32 and expert ids."""
    if moe.routing == "softmax":
        weights, ids = route(router_logits, moe.top_k, moe.renormalize)
    else:
        weights, ids = grouped_route(router_logits.float(), moe, correction_bias)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def grouped_route(logits: torch.Tensor, moe: MoEConfig,
                  correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited choice: "group_limited_greedy" (V2) or "noaux_tc" (V3); before the
    routed scaling factor."""
    n, experts = logits.shape
    sigmoid = moe.routing == "noaux_tc"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + correction_bias.float() if sigmoid and correction_bias is not None else scores
    if moe.num_groups > 1:
        by_group = choice.view(n, moe.num_groups, experts // moe.num_groups)
        group_scores = by_group.topk(2, dim=-1).values.sum(-1) if sigmoid else by_group.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, top_ids(group_scores, moe.topk_groups), True)
        # V3 rules the other groups' experts out (-inf); V2's reference zeroes their scores, so
        # where the kept groups hold fewer than top_k experts it takes zero-weight ones from others
        outside = float("-inf") if sigmoid else 0.0
        choice = choice.masked_fill(~keep.repeat_interleave(experts // moe.num_groups, dim=1), outside)
    ids = top_ids(choice, moe.top_k)
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids.contiguous()
