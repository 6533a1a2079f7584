"""Token sampling: grammar masks (engine/sample/structured_output.py), logit processing
(below), temperature, min-p, top-k, top-p, per-request seeds, and each
token's extras (engine/core/extras.py: logprobs).

One `Sampler` call turns a batch of last-position logits into one token per
sequence. Everything that can be batched is batched (temperature, top-k/top-p
masks with one sort per batch, unseeded draws); only seeded rows loop in Python,
because each must draw from its own `torch.Generator` to stay reproducible no
matter which other requests share the batch.

Logits processing (`process_logits`): what a request's sampling controls do to its logits before a token
is picked, in vLLM v1's order: logit_bias and min_tokens, then the penalties; temperature, min_p, top-k
and top-p follow in the sampler (Sampler, above). Logprobs are the model's own (taken before any of
this).

The formulas, as OpenAI's and vLLM's documentation write them, for token j with logit l[j] and
c[j] occurrences in the output so far:

    logit_bias          l[j] += bias[j]
    min_tokens          l[j] = -inf for j in the stop set while the output is shorter than min_tokens
    repetition_penalty  l[j] = l[j] / r if l[j] > 0 else l[j] * r, for j in the prompt or the output
    frequency/presence  l[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
    min_p               p[j] = 0 where p[j] < min_p * max(p), p = softmax(l / temperature)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.extras import Extras
from engine.core.request import Request, SamplingParams, TokenHistory

if TYPE_CHECKING:
    from engine.sample.structured_output import GrammarState

# Temperatures below this are treated as greedy: dividing by them overflows float32.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    """Result of one sampling step, one entry per sequence in batch order."""

    token_ids: list[int]
    extras: list[Extras | None]  # None where the request asked for none (`token_extras`)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """Build the per-request generator for a seeded request.

    Args:
        seed: `SamplingParams.seed`; None means the request uses the default generator.
        device: device the logits live on (generators are device-specific).
    Returns:
        A generator seeded with `seed`, or None for unseeded requests. The caller keeps it
        for the request's lifetime so successive steps continue one random stream.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _SAMPLING_EPS


class Sampler:
    """Stateless batch sampler; per-request random state lives in the caller's generators."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[TokenHistory | None] | None = None,
                 grammars: list[GrammarState | None] | None = None) -> SamplerOutput:
        """Pick one token per sequence.

        Args:
            logits: last-position logits, any float dtype; computed in float32.
            params: sampling params per sequence.
            generators: per-sequence generator (from `make_generator`), None = default generator.
            histories: per sequence, its tokens (penalties, min_tokens); None where none are needed.
            grammars: per sequence, its structured-output state, None where it has none: its mask
                applies first, before any other processing. The caller advances the states.
        Returns:
            SamplerOutput with one token id and its extras (or None) per sequence.
        Shape:
            logits: (num_seqs, vocab_size); len(params) == len(generators) == num_seqs.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
        raw = logits.float()  # (num_seqs, vocab_size): the model's, for logprobs
        logits = raw
        masked = grammars is not None and any(g is not None for g in grammars)
        if masked:
            from engine.sample.structured_output import apply_grammar_masks  # llguidance: only where grammars run
            logits = raw.clone()
            apply_grammar_masks(logits, grammars)
        if any(needs_processing(p) for p in params):
            processed = process_logits(logits.clone(), params, histories or [None] * len(params))
            logits = keep_grammar_tokens(processed, logits, grammars) if masked else processed
        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)  # (num_seqs,)
        else:
            token_ids = self._sample_mixed(logits, params, generators, greedy)
        return SamplerOutput(token_ids=token_ids.tolist(), extras=token_extras(raw, token_ids, params))

    def _sample_mixed(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None], greedy: list[bool]) -> torch.Tensor:
        """Argmax for greedy rows, random draws for the rest.

        Shape:
            logits: (num_seqs, vocab_size) float32 -> token ids (num_seqs,) int64.
        """
        token_ids = logits.argmax(dim=-1)  # (num_seqs,); sampled rows overwritten below
        rows = [i for i, g in enumerate(greedy) if not g]
        row_idx = torch.tensor(rows, device=logits.device)
        probs = probabilities(logits[row_idx], [params[i] for i in rows])  # (num_sampled, vocab_size)
        token_ids[row_idx] = _exponential_race(probs, [generators[i] for i in rows])
        return token_ids


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: its processed logits after temperature, min-p,
    top-k and top-p (the rows are not greedy).

    Shape:
        logits: (n, vocab_size) float32 -> (n, vocab_size), rows summing to 1.
    """
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    sub = logits / temps.unsqueeze(1)  # (n, vocab_size)
    min_p = [p.min_p for p in params]
    if any(min_p):
        sub = apply_min_p(sub, torch.tensor(min_p, device=device))
    top_k = [min(p.top_k, sub.shape[-1]) for p in params]  # past the vocabulary: keep all (no int64 overflow)
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sub = _apply_top_k_top_p(sub, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    return sub.softmax(dim=-1)


def keep_grammar_tokens(processed: torch.Tensor, masked: torch.Tensor, grammars: list[object | None]
                        ) -> torch.Tensor:
    """Where a grammar row's processing forbade every token its grammar allows (min_tokens holding
    back the EOS a finished grammar needs), the grammar wins: that row goes back to its masked logits.

    Shape:
        processed, masked: (num_seqs, vocab_size) -> (num_seqs, vocab_size).
    """
    idx = torch.tensor([i for i, g in enumerate(grammars) if g is not None], device=masked.device)
    rows = processed[idx]  # (num_rows, vocab_size)
    dead = (rows == float("-inf")).all(dim=-1, keepdim=True)  # no host sync
    processed[idx] = torch.where(dead, masked[idx], rows)
    return processed


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its nucleus, to -inf.

    Top-p is applied to the distribution left after top-k (as vLLM does): keep the smallest
    prefix of the descending-sorted tokens whose probability mass reaches `top_p`. The most
    likely token is always kept.

    Args:
        logits: temperature-scaled float32 logits.
        top_k: per-row k, 0 = off.
        top_p: per-row nucleus mass in (0, 1].
    Returns:
        Masked logits in the original token order.
    Shape:
        logits: (n, vocab_size); top_k, top_p: (n,) -> (n, vocab_size).
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (n, vocab_size)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
    ranks = torch.arange(vocab_size, device=logits.device)
    mask = ranks.unsqueeze(0) >= k.unsqueeze(1)  # (n, vocab_size): beyond top-k
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    mask |= mass_before >= top_p.unsqueeze(1)  # nucleus already complete before this token
    mask[:, 0] = False
    sorted_logits.masked_fill_(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row via argmax(probs / E), E ~ Exponential(1) i.i.d.

    This equals a categorical draw from `probs` and needs no CPU-GPU sync. Seeded rows draw
    their noise from their own generator, one row at a time, so a seeded request's tokens
    do not depend on its batch neighbours; unseeded rows share one batched draw from the
    default generator.

    Args:
        probs: normalized probabilities (masked tokens have probability 0).
        generators: per-row generator or None.
    Returns:
        Sampled token id per row.
    Shape:
        probs: (n, vocab_size) -> (n,) int64.
    """
    noise = torch.empty_like(probs)  # (n, vocab_size)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        noise[idx] = torch.empty_like(probs[idx]).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    # NOTE: exponential_ can return exactly 0; 0/0 would be NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def token_extras(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> list[Extras | None]:
    """Each row's extras (engine/core/extras.py), None where its request asked for none: the
    fields of the sampled tokens that the rows' params ask for, from the raw float32 logits.

    Shape:
        logits: (num_seqs, vocab_size); token_ids: (num_seqs,).
    """
    fields = [{} for _ in params]
    for i, lp in enumerate(gather_logprobs(logits, token_ids, params)):
        if lp is not None:
            fields[i]["logprobs"] = lp
    return [f or None for f in fields]


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     params: list[SamplingParams]) -> list[dict[int, float] | None]:
    """Logprobs of the sampled token and the top-n tokens, for rows that asked for them.

    Logprobs come from `log_softmax` of the raw (untempered, unmasked) logits: that is the
    model's own distribution, which is what OpenAI clients read `logprobs` as, and what vLLM
    returns by default.

    Args:
        logits: raw float32 logits.
        token_ids: sampled token per row.
        params: per-row params; `logprobs` None = skip the row, n = top-n plus sampled.
    Returns:
        Per row None or {token_id: logprob}, sampled token first.
    Shape:
        logits: (num_seqs, vocab_size); token_ids: (num_seqs,).
    """
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    row_idx = torch.tensor(rows, device=logits.device)
    logprobs = logits[row_idx].log_softmax(dim=-1)  # (num_rows, vocab_size)
    sampled = token_ids[row_idx]
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    max_n = min(max(params[i].logprobs for i in rows), logits.shape[-1])
    top_lp, top_ids = logprobs.topk(max_n, dim=-1)  # (num_rows, max_n)
    top_lp, top_ids, sampled = top_lp.tolist(), top_ids.tolist(), sampled.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        entry = {sampled[j]: sampled_lp[j]}
        for tok, lp in zip(top_ids[j][:n], top_lp[j][:n]):
            entry.setdefault(tok, lp)
        out[i] = entry
    return out


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
