"""Structured outputs (engine/sample/structured_output.py): grammar masks, spec checks, and the engine end to
end on the built-in SmolLM2-135M GGUF."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from decode_worker.llm import LLM
from engine.core.request import NewRequestData, Request, SamplingParams, SchedulerOutput, TokenHistory
from engine.sample.sampling import Sampler, history_of, needs_processing
from engine.sample.structured_output import (GrammarState, _unpack_numpy, _unpack_torch, apply_grammar_masks, check,
                                             grammar_of, ll_tokenizer)
from engine.text.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's logits width
EOS = 2  # <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
    "required": ["name", "age", "score", "color", "tags", "address"],
    "additionalProperties": False,
}
JSON_SPEC = ("json_schema", json.dumps(SCHEMA))
REGEX = r"[0-9]{1,3}( apples)?"
CHOICES = ["red", "green", "sky blue"]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path("smollm2")


@pytest.fixture(scope="session")
def llt(tokenizer):
    return ll_tokenizer(tokenizer, VOCAB, (EOS,))


@pytest.fixture(scope="session")
def llm():
    engine_llm = LLM(model="smollm2", dtype="float32", num_blocks=128, device="cpu")
    yield engine_llm
    engine_llm.engine.kv.assert_no_leaks()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed_by_matcher(state: GrammarState) -> torch.Tensor:
    """Reference: the allowed tokens through llguidance's other mask API (one byte per token)."""
    if state.failed:
        return torch.arange(state.vocab_size) == EOS
    bias = torch.frombuffer(bytearray(state.matcher.compute_logit_bias()), dtype=torch.uint8)
    return bias[:state.vocab_size] != 0


def _mask_of(state: GrammarState) -> torch.Tensor:
    bitmask = torch.zeros(1, (state.vocab_size + 31) // 32, dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0]


def _states(tokenizer, llt) -> list[GrammarState | None]:
    """Rows in different places: mid-JSON, mid-regex, a fresh choice, a finished grammar, a failed one."""
    finished = GrammarState("choice", json.dumps(CHOICES), llt, _ids(tokenizer, "red"))
    failed = GrammarState("regex", "ab", llt, _ids(tokenizer, "x"))
    assert finished.is_finished and failed.failed
    return [GrammarState(*JSON_SPEC, llt, _ids(tokenizer, '{"name":"Al')), None,
            GrammarState("regex", REGEX, llt, _ids(tokenizer, "12")), GrammarState("choice", json.dumps(CHOICES), llt),
            None, finished, failed]


@pytest.mark.parametrize("extra", [0, 40])
def test_batch_mask_equals_reference(tokenizer, llt, extra):
    """Rows with a grammar keep exactly the tokens llguidance allows (asked through its byte-per-token
    API) and -inf elsewhere, also past the tokenizer's vocabulary (a wider LM head); rows without one
    are untouched."""
    states = _states(tokenizer, llt)
    logits = torch.randn(len(states), VOCAB + extra, generator=torch.Generator().manual_seed(extra))
    want = logits.clone()
    for i, s in enumerate(states):
        if s is not None:
            allowed = torch.cat([_allowed_by_matcher(s), torch.zeros(extra, dtype=torch.bool)])
            want[i] = logits[i].masked_fill(~allowed, float("-inf"))
    got = logits.clone()
    apply_grammar_masks(got, states)
    assert torch.equal(got, want)
    assert 1 < int(torch.isfinite(got[0]).sum()) < VOCAB  # the grammar does narrow, and leaves a choice
    assert torch.isfinite(got[5]).nonzero().flatten().tolist() == [EOS]  # finished: only EOS


def test_unpack_paths_agree(tokenizer, llt):
    """The numpy path (CPU) and the torch path (GPU) decode the same bits: bit t % 32 of word t // 32."""
    states = [s for s in _states(tokenizer, llt) if s is not None]
    bitmask = torch.zeros(len(states), VOCAB // 32, dtype=torch.int32)
    for j, s in enumerate(states):
        s.fill_bitmask(bitmask, j)
    want = torch.stack([_allowed_by_matcher(s) for s in states])
    assert torch.equal(_unpack_numpy(bitmask, VOCAB), want)
    assert torch.equal(_unpack_torch(bitmask, VOCAB), want)


def test_sampler_masks_first_and_keeps_raw_logprobs(tokenizer, llt):
    """Greedy and seeded rows pick tokens their grammar allows; logprobs stay the model's; a finished
    grammar's EOS wins over min_tokens (which would forbid every token the grammar allows)."""
    states = _states(tokenizer, llt)
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3, top_k=50), SamplingParams(temperature=0.7, seed=4, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8),
              SamplingParams(temperature=1.0, seed=5)]
    histories = [TokenHistory(output=[1]) if p.min_tokens else None for p in params]
    histories[5] = TokenHistory(output=[1], stop_ids=frozenset({EOS}))
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    out = Sampler()(logits, params, gens, histories, states)
    for i, (s, t) in enumerate(zip(states, out.token_ids)):
        if s is None:
            assert t == int(logits[i].argmax())
        else:
            assert bool(_allowed_by_matcher(s)[t]), (i, t)
    assert out.token_ids[5] == EOS and out.token_ids[6] == EOS
    raw = logits[0].log_softmax(-1)
    assert out.extras[0]["logprobs"][out.token_ids[0]] == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-6)


@pytest.mark.parametrize("kind, spec, words", [
    ("xml", "<a/>", "unknown structured output kind"),
    ("json_schema", '{"type": "object"', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', "foo"),
    ("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}', "/nope"),
    ("json_schema", '{"type": "string", "pattern": "a(b"}', "unclosed group"),
    ("choice", "[]", "choice list is empty"),
    ("choice", '["a", 1]', "list of strings"),
    ("choice", "red", "choice is not valid JSON"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "", "regex is empty"),
    ("grammar", "start: foo", "foo"),
])
def test_bad_specs_are_refused(llt, kind, spec, words):
    """grammar_of and check raise ValueError with one line that names the problem."""
    for call in (lambda: grammar_of(kind, spec), lambda: check(kind, spec, llt)):
        with pytest.raises(ValueError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind, spec", [JSON_SPEC, ("json_object", ""), ("regex", REGEX),
                                        ("choice", json.dumps(CHOICES)), ("grammar", 'start: "yes" | "no"')])
def test_good_specs_pass(llt, kind, spec):
    """Every kind is accepted with a sound spec, and its matcher starts without error."""
    check(kind, spec, llt)
    state = GrammarState(kind, spec, llt, request_id="ok")
    assert not state.failed and not state.is_finished
    assert grammar_of(kind, spec)


def test_rejected_token_fails_without_raising(tokenizer, llt):
    """A token the grammar rejects marks the state failed; from then on only EOS is allowed."""
    state = GrammarState("regex", "ab+", llt, _ids(tokenizer, "a"), request_id="r")
    assert not state.failed
    assert not state.accept(_ids(tokenizer, "x")[0])
    assert state.failed and state.is_finished
    assert _unpack_numpy(_mask_of(state)[None], VOCAB)[0].nonzero().flatten().tolist() == [EOS]
    assert not state.accept(_ids(tokenizer, "b")[0])  # stays failed


def test_rebuilt_state_equals_live_state(tokenizer, llt):
    """A state built from the first k tokens has the mask the state fed them one by one has, at every k."""
    tokens = _ids(tokenizer, '{"name":"Bo","age":3,"score":1.5,"color":"red","tags":["a"],'
                             '"address":{"city":"Rome","zip":"00100"}}') + [EOS]
    live = GrammarState(*JSON_SPEC, llt)
    for k, t in enumerate(tokens):
        assert torch.equal(_mask_of(GrammarState(*JSON_SPEC, llt, tokens[:k])), _mask_of(live)), k
        assert live.accept(t), k
    assert live.is_finished and not live.failed


def test_structured_request_carries_its_output():
    """A structured request's history holds its output tokens (the runner rebuilds the grammar from
    them), and a grammar alone is no logit processing."""
    sp = SamplingParams(structured_output=("regex", "a+"))
    req = Request("r", [5, 6], sp, output_token_ids=[7, 8])
    assert history_of(req).output == [7, 8]
    assert not needs_processing(sp)


@pytest.fixture(scope="session")
def generated(llm):
    """Greedy and seeded outputs for a JSON schema, a regex and a choice, with every live mask the
    runner computed recorded as (request id, tokens consumed, bitmask row)."""
    records = []
    fill = GrammarState.fill_bitmask

    def spy(self, bitmask, row):
        fill(self, bitmask, row)
        records.append((self.request_id, self.num_tokens, bitmask[row].clone()))

    specs = [JSON_SPEC, JSON_SPEC, JSON_SPEC, ("regex", REGEX), ("regex", REGEX), ("choice", json.dumps(CHOICES)),
             ("choice", json.dumps(CHOICES))]
    prompts = ["Describe a person as JSON.", "Give me a JSON record for a customer named Ann.",
               "Describe a cat as JSON.", "What is 6*7?", "How many apples are in a box?", "Pick a color.",
               "What color is the sky?"]
    temps = [(0.0, None), (0.8, 3), (1.0, 7), (0.0, None), (0.9, 2), (0.0, None), (0.7, 1)]
    params = [SamplingParams(max_tokens=100, temperature=t, seed=seed, structured_output=so)
              for so, (t, seed) in zip(specs, temps)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GrammarState, "fill_bitmask", spy)
        outs = llm.generate(prompts, params, chat=True)
    return list(zip(outs, specs)), records


@pytest.mark.slow
def test_outputs_match_their_grammar(generated):
    """Every output that ended by EOS parses and validates (JSON schema), matches (regex) or is one
    of the choices; most end by EOS, greedy ones all do."""
    pairs, _ = generated
    for out, (kind, spec) in pairs:
        if out.finish_reason != "stop":
            continue
        assert out.token_ids[-1] == EOS
        if kind == "json_schema":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
        else:
            assert out.text in CHOICES
    stops = [out.finish_reason == "stop" for out, _ in pairs]
    assert sum(stops) >= len(stops) - 1 and stops[0] and stops[3] and stops[5], [o.text for o, _ in pairs]


@pytest.mark.slow
def test_runner_rebuilds_the_live_state(generated, llm):
    """The mask a state rebuilt from the first k output tokens gives equals the runner's live one at k,
    both for a bare GrammarState and for the runner's own build from a new request's history."""
    pairs, records = generated
    runner = llm.engine.runner
    by_id = {out.request_id: (out, so) for out, so in pairs}
    checked = 0
    for rid, k, live in records[::3]:
        out, (kind, spec) = by_id[rid]
        assert torch.equal(_mask_of(GrammarState(kind, spec, runner.grammar_tokenizer(), out.token_ids[:k])), live)
        checked += k > 0
    assert checked > 10
    rid, k, live = next(r for r in reversed(records) if r[0] == pairs[0][0].request_id and r[1] > 5)
    out, so = by_id[rid]
    sp = SamplingParams(structured_output=so)
    new = NewRequestData("rebuilt", [1], 0, ([1],), sp, False, TokenHistory(output=list(out.token_ids[:k])))
    runner.update_states(SchedulerOutput(new_requests=[new]))
    state = runner.requests["rebuilt"].grammar
    assert state.num_tokens == k and torch.equal(_mask_of(state), live)
    runner.update_states(SchedulerOutput(new_requests=[new]))  # resumed: the same state goes on
    assert runner.requests["rebuilt"].grammar is state
    runner.update_states(SchedulerOutput(finished_req_ids=["rebuilt"]))


@pytest.mark.slow
def test_ignore_eos_after_the_grammar_ends(llm):
    """With ignore_eos a finished grammar still allows only EOS: the text is one choice, the rest EOS,
    and the request ends at max_tokens."""
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                        structured_output=("choice", json.dumps(CHOICES)))
    out, = llm.generate(["Pick a color."], sp, chat=True)
    assert out.finish_reason == "length" and out.text in CHOICES
    n = len(out.token_ids) - out.token_ids.index(EOS)
    assert out.token_ids[-n:] == [EOS] * n and n < 8


@pytest.mark.slow
def test_a_retry_rebuilds_its_grammar_from_the_tokens_in_its_prompt(generated, llm, tokenizer):
    """The router retries a request with the tokens it already streamed at the end of the prompt
    (num_resumed_tokens): the grammar takes them as output, so greedy decoding goes on exactly as the
    first attempt did, and the whole output still validates."""
    (out, so), = [p for p in generated[0][:1]]
    k = len(out.token_ids) // 2
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    sp = SamplingParams(max_tokens=100 - k, temperature=0.0, structured_output=so, num_resumed_tokens=k)
    retry, = llm.generate([prompt + out.token_ids[:k]], sp)
    assert out.token_ids[:k] + retry.token_ids == out.token_ids
    jsonschema.validate(json.loads(tokenizer.decode(out.token_ids[:k] + retry.token_ids)), SCHEMA)
