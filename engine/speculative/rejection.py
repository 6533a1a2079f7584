"""Verification: which proposed tokens the target keeps, and the token that follows them.

For sequence b with k drafts x_1..x_k and the target's distributions p_1..p_{k+1} (p_i at the
position of x_i; p_{k+1} after the last draft), the standard speculative sampling (Leviathan et
al. 2023; Chen et al. 2023): x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), q_i the
proposer's distribution (a point mass on x_i for a proposer without one, as the n-gram's). At the
first rejection the token is drawn from normalize(max(0, p_i - q_i)) and the run ends; when every
draft is accepted, a bonus token is drawn from p_{k+1}. The tokens so produced are distributed as
the target's own samples. Greedy (temperature 0): x_i is accepted iff it is p_i's argmax, and the
token at the first rejection (or the bonus) is the argmax: the target's greedy output exactly.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     greedy: bool = False, generator: torch.Generator | None = None) -> list[list[int]]:
    """target_probs (B, k + 1, V) float, drafts (B, k) int64, draft_probs (B, k, V) or None (point
    masses) -> per sequence its output tokens this step: the accepted drafts, then one more token
    (1 to k + 1 tokens)."""
    batch, k = drafts.shape
    if greedy:
        best = target_probs.argmax(dim=-1)  # (B, k + 1)
        accepted = (best[:, :k] == drafts).int().cumprod(dim=1).sum(dim=1)
        return [drafts[b, :n].tolist() + [int(best[b, n])] for b, n in enumerate(accepted.tolist())]
    rows = torch.arange(batch, device=target_probs.device)
    p_draft = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # p_i(x_i), (B, k)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(batch, k, generator=generator, device=target_probs.device)
    accepted = (u * q_draft <= p_draft).int().cumprod(dim=1).sum(dim=1)  # u < p / q, never dividing by q
    # the last token: from p - q at the first rejection, from p after the last draft
    p_next = target_probs[rows, accepted]  # (B, V)
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, drafts[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    rejected = (accepted < k)[:, None]
    residual = torch.where(rejected, (p_next - q_next).clamp_min(0), p_next)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)  # p == q exactly: p itself
    tokens = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    return [drafts[b, :n].tolist() + [t] for b, (n, t) in enumerate(zip(accepted.tolist(), tokens.tolist()))]
