"""Speculative decoding on the decode instance: disaggregated output equals plain colocated decoding
bit for bit (the batch-invariant mode), the n = 3 and the structured-output requests included, for
each proposer, and with a decode instance of 3 TP ranks. The draft model's KV is computed on the
prefill instance and comes with the prompt's KV, as an EAGLE-3 head's rows of the prompt do
(docs/speculative.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.eagle3_head import save_eagle3_head
from cluster.control.cluster import Cluster
from engine.text.tokenizer import Tokenizer
from tests.exactness.matrix import Case, mismatches, reference, serve, spec_of
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    """A one-layer random draft over the target's vocabulary."""
    vocab = Tokenizer.from_path("smollm2").backend.get_vocab_size()
    return str(save_tiny_llama(tmp_path_factory.mktemp("spec") / "draft", seed=6, vocab_size=vocab, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=1))


@pytest.fixture(scope="module")
def head(model, tmp_path_factory) -> str:
    """A random EAGLE-3 head over 4,096 of the target's tokens, reading its layers (1, 1, 0)."""
    config = json.loads((Path(model) / "config.json").read_text())
    return str(save_eagle3_head(tmp_path_factory.mktemp("spec") / "head", config, seed=2, draft_vocab=4096,
                                aux_ids=[1, 1, 0]))


@pytest.fixture(scope="module")
def plain(model):
    return serve(reference("auto"), model)


@pytest.mark.parametrize("method,layout", [("ngram", "1P1D"), ("draft_model", "1P1D"), ("self", "1P1D"),
                                           ("ngram", "P1-D3"), ("draft_model", "P1-D3"), ("eagle3", "1P1D"),
                                           ("eagle3", "P1-D3")])
def test_speculative_disaggregated_equals_plain_colocated(model, draft, head, plain, method, layout, request):
    """Every request's tokens and logprobs, bit for bit; drafts were proposed, and kept where they can
    be (the random draft over 49152 tokens keeps next to none; the target as its own draft, all of
    them, where no grammar forbids what it proposes)."""
    case = Case(layout=layout, concurrency=8, structured=method != "self")
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    # one TP case measures its limit at load (every rank profiles, in step, or the group hangs); the
    # others give it, as whether a tiny model's drafts pay is a matter of timing on a busy host
    profiled = (method, layout) == ("eagle3", "P1-D3")
    knobs = {"speculative_method": "draft_model" if method == "self" else method,
             "speculative_model": {"draft_model": draft, "self": model, "eagle3": head}.get(method),
             "num_speculative_tokens": 3, "speculative_max_batch_size": None if profiled else 16}
    with Cluster(spec_of(case, model, **knobs), use_ray=case.needs_ray) as cluster:
        assert mismatches(serve(case, model, cluster=cluster), plain) == []
        loads = [i.client.load() for i in cluster.instances.values() if i.role == "decode"]
    proposed = sum(v for load in loads for k, v in load.items() if k.startswith("spec_proposed/"))
    accepted = sum(v for load in loads for k, v in load.items() if k.startswith("spec_accepted/"))
    if method != "ngram":  # the draft's KV or the head's rows of the prompts came with their KV
        assert sum(load["spec_rows_received"] for load in loads) > 0, loads
    # a limit measured on at some size now was on from the start (it assumes every draft kept until
    # measured); one off at every size now may have been off from the start
    if profiled and all(load["spec_max_batch"] == 0 for load in loads):
        return
    assert proposed > 0, loads
    if method in ("ngram", "self"):
        assert accepted > 0, loads
    if method == "self":
        assert accepted == proposed
