"""What a request's sampling controls do to its logits before a token is picked, in vLLM v1's
order: logit_bias and min_tokens, then the penalties; temperature, min_p, top-k and top-p follow
in the sampler (engine/sample/sampling.py). Logprobs are the model's own (taken before any of this).

The formulas, as OpenAI's and vLLM's documentation write them, for token j with logit l[j] and
c[j] occurrences in the output so far:

    logit_bias          l[j] += bias[j]
    min_tokens          l[j] = -inf for j in the stop set while the output is shorter than min_tokens
    repetition_penalty  l[j] = l[j] / r if l[j] > 0 else l[j] * r, for j in the prompt or the output
    frequency/presence  l[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
    min_p               p[j] = 0 where p[j] < min_p * max(p), p = softmax(l / temperature)
"""
from __future__ import annotations

import torch

from engine.core.batch import TokenHistory
from engine.core.request import Request, SamplingParams


def history_of(req: Request) -> TokenHistory | None:
    """What the runner keeps of `req` for its sampling controls and its grammar (structured output:
    the runner rebuilds the grammar's state from `output`); None when they read no tokens."""
    sp = req.sampling_params
    if not sp.needs_token_history:
        return None
    stop_ids = (frozenset() if sp.ignore_eos else req.eos_token_ids) | frozenset(sp.stop_token_ids)
    k, prompt = sp.num_resumed_tokens, req.prompt_token_ids  # a retry's earlier output ends its prompt
    return TokenHistory(frozenset(prompt[:len(prompt) - k]), prompt[len(prompt) - k:] + req.output_token_ids,
                        stop_ids, k)


def needs_processing(p: SamplingParams) -> bool:
    """Whether `process_logits` changes this row (a grammar alone reads the history, changes nothing here)."""
    return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or p.min_tokens)


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
                   ) -> torch.Tensor:
    """Applies each row's logit_bias, min_tokens and penalties, in place.

    Shape:
        logits: (num_seqs, vocab_size) float32; one params and history per row.
    """
    vocab = logits.shape[-1]
    for i, (p, h) in enumerate(zip(params, histories)):
        if not needs_processing(p):
            continue
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=row.device))
        if p.min_tokens and len(h.output) - h.num_resumed < p.min_tokens and h.stop_ids:
            row[torch.tensor(sorted(h.stop_ids), device=row.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.output).union(h.prompt)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and h.output:
            counts = torch.bincount(torch.tensor(h.output, device=row.device), minlength=vocab)[:vocab].float()
            row -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits with the tokens below min_p times each row's likeliest
    probability set to -inf (before top-k and top-p, as in vLLM).

    Shape:
        logits: (n, vocab_size); min_p: (n,) -> (n, vocab_size).
    """
    probs = logits.softmax(dim=-1)
    drop = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(drop, float("-inf"))
