"""Speculative decoding through the colocated engine on tiny random models: greedy output equal to
plain decoding over mixed batches for every proposer, the block tables of the scheduler and the
runner in step after each rollback, the sampling controls keeping their meaning."""
from __future__ import annotations

from dataclasses import replace

import pytest

from decode_worker.engine import ColocatedEngine
from engine.core.request import SamplingParams
from engine.core.speculative_config import SpeculativeConfig
from engine.runner.model_runner import ModelRunner
from tests.helpers import engine_config, random_prompts, save_tiny

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target, and a draft of the same shape with other random weights."""
    root = tmp_path_factory.mktemp("spec")
    return save_tiny(root / "target", seed=0), save_tiny(root / "draft", seed=1)


def make_engine(path, spec: SpeculativeConfig | None = None, **knobs) -> ColocatedEngine:
    knobs.setdefault("max_num_batched_tokens", 64)  # the longest prompt is prefilled in chunks beside decodes
    knobs.setdefault("block_size", 4)  # drafts often cross into a new block: their rollback frees it
    cfg = replace(engine_config(model=str(path), **knobs), speculative=spec)
    return ColocatedEngine(cfg, runner=ModelRunner(cfg))


def prompts() -> list[list[int]]:
    """Random prompts, one that repeats itself (n-grams recur) and one long enough to be chunked."""
    loop = random_prompts(1, [12], seed=7)[0]
    return [*random_prompts(3, [5, 17, 9], seed=3), loop * 4, random_prompts(1, [150], seed=4)[0]]


def run(engine: ColocatedEngine, params: list[SamplingParams], check_tables: bool = True):
    """Every prompt to the end; after each step the runner's block tables are the scheduler's."""
    ids = [f"r{i}" for i in range(len(params))]
    for rid, p, sp in zip(ids, prompts(), params):
        engine.add_request(rid, p, sp)
    reqs = {rid: engine.scheduler.requests[rid] for rid in ids}
    while engine.has_unfinished():
        engine.step()
        for r in engine.scheduler.running:
            if check_tables and r.request_id in engine.runner.requests:
                assert engine.runner.requests[r.request_id].block_ids == list(engine.kv.get_block_ids(r.request_id))
    engine.kv.assert_no_leaks()
    return [reqs[rid] for rid in ids]


def assert_same_greedy(want, got) -> None:
    """Equal tokens, or a first difference where the reference's top two were a near-tie."""
    for w, g in zip(want, got):
        if w.output_token_ids == g.output_token_ids:
            continue
        j = next(i for i, (a, b) in enumerate(zip(w.output_token_ids, g.output_token_ids)) if a != b)
        top = sorted(w.output_extras[j]["logprobs"].values(), reverse=True)
        assert top[0] - top[1] < 1e-4, (w.request_id, j, top[:2])


def record_drafts(engine) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens, its drafts) of every proposal from here on."""
    seen, propose = [], engine.speculator.proposer.propose

    def recording(seqs):
        drafts = propose(seqs)
        seen.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts) if d)
        return drafts
    engine.speculator.proposer.propose = recording
    return seen


GREEDY = [SamplingParams(max_tokens=MAX_TOKENS - i, temperature=0.0, ignore_eos=True, logprobs=2) for i in range(5)]


@pytest.fixture(scope="module")
def plain(models):
    return run(make_engine(models[0]), GREEDY)


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_random"])
def test_greedy_output_equals_plain_decoding(models, plain, method):
    """Mixed batches: decodes, verifies and a prompt's chunks in one step. The target as its own
    draft keeps every draft; another random model keeps few; both stay exact."""
    target, other = models
    spec = SpeculativeConfig("draft_model" if method != "ngram" else "ngram", 3,
                             model={"draft_self": str(target), "draft_random": str(other)}.get(method),
                             max_batch_size=64)
    engine = make_engine(target, spec)
    got = run(engine, GREEDY)
    assert_same_greedy(plain, got)
    assert [len(r.output_token_ids) for r in got] == [p.max_tokens for p in GREEDY]
    s = engine.speculator
    assert s.proposed[0] > 20, s.proposed
    if method == "draft_self":
        assert s.accepted == s.proposed
    if method == "draft_random":
        assert sum(s.accepted) < sum(s.proposed) / 2, (s.accepted, s.proposed)


def test_batch_invariant_speculation_is_bit_equal(models):
    """In the batch-invariant mode a verify step's logits are a decode step's, bit for bit."""
    want = run(make_engine(models[0], batch_invariant=True), GREEDY)
    engine = make_engine(models[0], SpeculativeConfig("draft_model", 4, model=str(models[0]), max_batch_size=64),
                         batch_invariant=True)
    got = run(engine, GREEDY)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert [r.output_extras for r in got] == [r.output_extras for r in want]
    assert engine.speculator.accepted == engine.speculator.proposed and engine.speculator.proposed[3] > 10


def test_sampling_controls_keep_their_meaning(models):
    """Penalties, logit_bias, min_tokens with EOS and stop ids, n = 2: read along the drafts, the
    output is plain decoding's (the target as its own draft proposes what plain decoding picks)."""
    eos, stop_id = 2, 5
    params = [SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, logprobs=1),
              SamplingParams(max_tokens=18, temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(max_tokens=16, temperature=0.0, min_tokens=12, stop_token_ids=(stop_id,),
                             logit_bias=((eos, 9.0), (stop_id, 9.0))),
              SamplingParams(max_tokens=14, temperature=0.0, n=2),
              SamplingParams(max_tokens=9, temperature=0.0, logit_bias=((stop_id, 4.0),), stop_token_ids=(stop_id,))]
    want = run(make_engine(models[0]), params)
    engine = make_engine(models[0], SpeculativeConfig("draft_model", 3, model=str(models[0]), max_batch_size=64))
    got = run(engine, params)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert len(got[2].output_token_ids) == 13 and got[2].output_token_ids[-1] in (eos, stop_id)
    assert engine.speculator.accepted[0] > 5


def test_sampled_speculation_is_seeded_and_ends_where_asked(models):
    """temperature > 0: a seed gives the same output twice; max_tokens is never passed."""
    params = [SamplingParams(max_tokens=MAX_TOKENS - i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(5)]
    spec = SpeculativeConfig("draft_model", 3, model=str(models[0]), max_batch_size=64)
    first = run(make_engine(models[0], spec), params)
    again = run(make_engine(models[0], spec), params)
    assert [r.output_token_ids for r in first] == [r.output_token_ids for r in again]
    assert [len(r.output_token_ids) for r in first] == [p.max_tokens for p in params]


def test_a_draft_that_cannot_propose_is_refused(models, tmp_path):
    big = save_tiny(tmp_path / "big", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary \\(300 tokens\\) is larger than the target's \\(256\\)"):
        make_engine(models[0], SpeculativeConfig("draft_model", 3, model=str(big), max_batch_size=8))


def test_the_kv_budget_counts_the_draft_pool(models):
    """The draft is loaded before the target sizes its pool: kv_memory_gib holds both pools, block
    for block (on a GPU the device budget counts its weights too: bench/gpu_check.py)."""
    from engine.core.kv_cache import kv_block_bytes
    plain = ModelRunner(replace(engine_config(model=str(models[0]), num_blocks=None), speculative=None))
    spec = SpeculativeConfig("draft_model", 3, model=str(models[1]), max_batch_size=8)
    runner = ModelRunner(replace(engine_config(model=str(models[0]), num_blocks=None), speculative=spec))
    target_bytes = kv_block_bytes(runner.model_config, runner.num_kv_heads, runner.block_size, runner.kv_dtype)
    draft_bytes = kv_block_bytes(runner.draft.runner.model_config, runner.draft.runner.num_kv_heads, runner.block_size,
                                 runner.draft.runner.kv_dtype)
    budget = int(runner.config.cache.memory_gib * 2**30)
    assert plain.num_blocks == budget // target_bytes
    assert runner.num_blocks == budget // (target_bytes + draft_bytes) == runner.draft.num_blocks
    assert runner.draft.runner.kv_cache.shape[2] == runner.num_blocks


def test_the_draft_catches_up_with_a_long_prompt_in_chunks(models, plain, monkeypatch):
    """16 prompt tokens per step for the draft's prefill: the 48- and 150-token prompts speculate only
    once their draft KV is complete; the output is unchanged and every draft still kept."""
    from engine.speculative import draft_model
    monkeypatch.setattr(draft_model, "CATCH_UP_TOKENS", 16)
    fed: dict[str, list[int]] = {}  # request id -> tokens of each draft forward it was in
    forward = draft_model.DraftModelProposer._forward

    def spy(self, reqs):
        for r in reqs:
            fed.setdefault(r.request_id, []).append(len(r.token_ids))
        return forward(self, reqs)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_forward", spy)
    engine = make_engine(models[0], SpeculativeConfig("draft_model", 3, model=str(models[0]), max_batch_size=64))
    got = run(engine, GREEDY)
    assert_same_greedy(plain, got)
    s = engine.speculator
    assert s.accepted == s.proposed and s.proposed[0] > 20
    # r4's 150 prompt tokens, and those it decodes meanwhile (one a step, without drafts), 16 per step
    full = next(i for i, n in enumerate(fed["r4"]) if n < 16)
    assert max(max(n) for n in fed.values()) == 16 and full >= 150 // 16


def test_a_prefills_draft_kv_gives_the_decode_draft_the_colocated_drafts(models):
    """A prefill runner with the draft beside it (the decode's spec as ship_proposer_rows) computes
    the prompt's draft KV; a decode engine's draft given it in other blocks, with the prompt's first
    token, proposes what a colocated engine's draft proposes after computing the prompt itself."""
    from engine.core.request import NewRequestData, SchedulerOutput
    from engine.speculative.base import SpecSequence
    from engine.speculative.rows import DraftKVRecorder
    target, draft = models
    spec = SpeculativeConfig("draft_model", 3, model=str(draft), max_batch_size=64)
    prompt, params = random_prompts(1, [37], seed=12)[0], SamplingParams(max_tokens=8, temperature=0.0)
    colocated = make_engine(target, spec)
    seen = record_drafts(colocated)
    colocated.add_request("r", prompt, params)
    while not seen:
        colocated.step()
    tokens, drafts = seen[0]
    prefill = ModelRunner(replace(engine_config(model=str(target), block_size=4), ship_proposer_rows=spec))
    assert isinstance(prefill.draft, DraftKVRecorder) and prefill.draft.block_bytes() > 0
    prefill.draft.observing = True
    blocks = [3 + i for i in range(10)]
    prefill.execute(SchedulerOutput(new_requests=[NewRequestData("r", prompt, 0, (blocks,), params, True)]))
    start, rows = prefill.draft.take("r", blocks, len(prompt))
    assert start == 0 and rows.shape == (len(prompt), 3 * 2 * 2 * 16)  # 3 layers, K and V, 2 KV heads of 16
    decode = make_engine(target, spec)
    other = [20 + i for i in range(12)]
    decode.runner.draft.receive_rows("r", start, rows, other, tokens)
    assert decode.speculator.proposer.propose([SpecSequence("r", tokens, 3, (other,))]) == [drafts]
    assert decode.speculator.figures()["spec_rows_received"] == len(prompt)
