"""EAGLE-3 heads through the colocated engine: every draft is the reference head's on transformers'
own hidden states of the target; greedy output equals plain decoding over mixed batches, with a
random head (which keeps few drafts) and with one built to keep many; the head's pool is whole again
when every request is done."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bench.eagle3_head import save_eagle3_head
from engine.core.request import SamplingParams
from engine.core.speculative_config import SpeculativeConfig
from tests.engine.speculative.eagle3_heads import ReferenceHead
from tests.engine.speculative.test_engine import GREEDY, assert_same_greedy, make_engine, prompts, record_drafts, run
from tests.helpers import make_hf_tiny, random_prompts, save_tiny

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("eagle3") / "target", seed=0)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A random head over 200 of the target's 256 tokens, reading layers (2, 1, 0): vLLM's default for 3 layers."""
    config = json.loads((target / "config.json").read_text())
    return save_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", config, seed=5, draft_vocab=200)


@pytest.fixture(scope="module")
def plain(target):
    return run(make_engine(target), GREEDY)


def spec(head) -> SpeculativeConfig:
    return SpeculativeConfig("eagle3", K, model=str(head), max_batch_size=64)


def assert_pool_whole(engine) -> None:
    head = engine.runner.draft
    assert head.seqs == {} and sorted(head.free) == list(range(1, head.num_blocks))


def test_drafts_are_the_reference_heads(target, head, plain):
    """Each step's drafts, against the reference head fed transformers' hidden states of the target
    over the same tokens (layers 2, 1, 0) from position 0: the catch-up after each verify step, the
    chunked prompt, the draft steps. A differing draft is allowed only at a near-tie of the reference."""
    engine = make_engine(target, spec(head))
    seen = record_drafts(engine)
    assert_same_greedy(plain, run(engine, GREEDY))
    assert_pool_whole(engine)
    assert compare_with_reference(target, head, seen[::3]) > 20


def test_a_sequence_that_waited_catches_up(target, head):
    """Speculation on for one decoding sequence only: the first request decodes beside the others
    with no drafts, gaining a row a step, then alone; its first drafts are still the reference's,
    fed every row since."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (36, 10, 10, 10, 10)]
    want = run(make_engine(target), params)
    engine = make_engine(target, SpeculativeConfig("eagle3", K, model=str(head), max_batch_size=1))
    seen = record_drafts(engine)
    assert_same_greedy(want, run(engine, params))
    assert_pool_whole(engine)
    first = min(len(tokens) for tokens, _ in seen)
    assert first > len(prompts()[0]) + 8, first  # it waited
    assert compare_with_reference(target, head, seen) > 5


def test_a_prefills_rows_give_the_decode_head_the_colocated_drafts(target, head):
    """A prefill runner records a prompt's rows (RowRecorder: the decode's spec as ship_proposer_rows,
    no head loaded); a decode engine's head given them with the prompt's first token proposes what
    a colocated engine's head proposes after computing the prompt itself."""
    from dataclasses import replace

    from engine.core.request import NewRequestData, SchedulerOutput
    from engine.runner.model_runner import ModelRunner
    from engine.speculative.base import SpecSequence
    from engine.speculative.rows import RowRecorder
    from tests.helpers import engine_config
    prompt, params = random_prompts(1, [37], seed=12)[0], SamplingParams(max_tokens=8, temperature=0.0)
    colocated = make_engine(target, spec(head))
    seen = record_drafts(colocated)
    colocated.add_request("r", prompt, params)
    while not seen:
        colocated.step()
    tokens, drafts = seen[0]
    assert tokens[:-1] == prompt
    prefill = ModelRunner(replace(engine_config(model=str(target), block_size=4), ship_proposer_rows=spec(head)))
    assert isinstance(prefill.draft, RowRecorder) and prefill.draft.block_bytes() == 0
    prefill.draft.observing = True
    tables = ([1 + i for i in range(-(-len(prompt) // 4))],)
    out = prefill.execute(SchedulerOutput(new_requests=[NewRequestData("r", prompt, 0, tables, params, True)]))
    assert out.sampled_token_ids["r"] == tokens[-1]
    start, rows = prefill.draft.take("r", tables[0], len(prompt))
    assert start == 0 and rows.shape == (len(prompt), 3 * 64) and prefill.draft.take("r", tables[0], 1) is None
    decode = make_engine(target, spec(head))
    decode.runner.draft.receive_rows("r", start, rows)
    assert decode.speculator.proposer.propose([SpecSequence("r", tokens, K)]) == [drafts]
    assert decode.speculator.figures()["spec_rows_received"] == len(prompt)


def compare_with_reference(target, head, seen, base: int = 0) -> int:
    """Asserts each (tokens, drafts) is the reference head's, fed from position `base`; how many were compared."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    ref = ReferenceHead(load_file(head / "model.safetensors"), json.loads((head / "config.json").read_text()),
                        hf.model.embed_tokens.weight.detach())
    for tokens, drafts in seen:
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        rows = torch.cat([states[i][0] for i in (2, 1, 0)], -1)[base:]
        want, gaps = ref.drafts(rows, tokens[base + 1:], len(drafts), base)
        for w, g, gap in zip(want, drafts, gaps):
            assert w == g or gap < 1e-3, (len(tokens), want, drafts, gaps)
            if w != g:
                break
    return len(seen)


def test_a_prefix_hit_is_outside_the_heads_context(target, head):
    """A prompt whose first blocks are cached: the head's context starts at the first token computed
    here, at its own position (the reference fed from there)."""
    engine = make_engine(target, spec(head))
    prompt = random_prompts(1, [40], seed=11)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("first", prompt, params)
    while engine.has_unfinished():
        engine.step()
    seen = record_drafts(engine)
    again = engine.add_request("again", prompt + [7, 8, 9], params)
    while engine.has_unfinished():
        engine.step()
    assert again.num_cached_tokens == 40 and len(seen) > 2
    compare_with_reference(target, head, seen, base=again.num_cached_tokens)
    assert_pool_whole(engine)


def test_a_random_head_keeps_the_output_exact(target, head, plain):
    engine = make_engine(target, spec(head))
    got = run(engine, GREEDY)
    assert_same_greedy(plain, got)
    s = engine.speculator
    assert s.proposed[0] > 20 and sum(s.accepted) < sum(s.proposed) / 2, (s.proposed, s.accepted)
    assert_pool_whole(engine)


def test_forked_choices_leave_the_pool_whole(target, head):
    """n = 2: the parent's rows and blocks are dropped at the fork, each choice starts its own."""
    params = [*GREEDY[:4], SamplingParams(max_tokens=14, temperature=0.0, n=2, logprobs=2)]
    want = run(make_engine(target), params)
    engine = make_engine(target, spec(head))
    got = run(engine, params)
    assert_same_greedy(want, got)
    assert engine.speculator.proposed[0] > 20
    assert_pool_whole(engine)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A target whose last layer adds nothing, and a head that reads that layer's input and has the
    target's final norm and LM head: it proposes the target's last token again, k times, which the
    target keeps while it repeats itself. (target folder, head folder)"""
    root = tmp_path_factory.mktemp("eagle3")
    hf = make_hf_tiny("llama", seed=3)
    last = hf.model.layers[-1]
    with torch.no_grad():
        last.self_attn.o_proj.weight.zero_()
        last.mlp.down_proj.weight.zero_()
    hf.save_pretrained(root / "target", safe_serialization=True)
    config, h = hf.config.to_dict(), hf.config.hidden_size
    zero = torch.zeros
    tensors = {"fc.weight": torch.cat([torch.eye(h), zero(h, 2 * h)], 1),
               "midlayer.self_attn.o_proj.weight": zero(h, h), "midlayer.mlp.down_proj.weight": zero(h, 128),
               "norm.weight": hf.model.norm.weight.detach().clone(),
               "lm_head.weight": hf.lm_head.weight.detach().clone(),
               "d2t": zero(256, dtype=torch.int64), "t2d": torch.ones(256, dtype=torch.bool)}
    return root / "target", save_eagle3_head(root / "head", config, seed=1, aux_ids=[2, 2, 2], tensors=tensors)


def test_a_head_that_keeps_drafts_stays_exact(repeating):
    """Whole runs of drafts kept: after such a verify step the head feeds the rows of every kept
    position, and the output is still plain decoding's."""
    target, head = repeating
    want = run(make_engine(target), GREEDY)
    engine = make_engine(target, spec(head))
    seen = record_drafts(engine)
    assert_same_greedy(want, run(engine, GREEDY))
    bad = [(t[-4:], d) for t, d in seen if d != [t[-1]] * len(d)]  # fewer than K near max_tokens
    assert not bad, (len(bad), len(seen), bad[:8])
    s = engine.speculator
    assert s.accepted[K - 1] > 2 and sum(s.accepted) < sum(s.proposed), (s.proposed, s.accepted)
    assert_pool_whole(engine)


def test_a_checkpoint_that_is_no_head_is_refused(target):
    with pytest.raises(ValueError, match="architecture 'LlamaForCausalLM' is not an EAGLE-3 head"):
        make_engine(target, spec(target))
