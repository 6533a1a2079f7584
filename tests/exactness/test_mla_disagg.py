"""DeepSeek's latent attention served disaggregated equals colocated: 1P1D, a prefill of two TP
ranks feeding a decode of one, and one feeding two. Each decode rank receives every token's
latent entry once, whatever the TP sizes (the entry is not split by heads: every rank holds it).

Not in the batch-invariant mode (MLA does not run in it): as for the mixtures
(tests/exactness/test_moe_disagg.py), outputs equal up to a first differing token that must be a
near-tie of the reference's, logprobs within LOGPROB_TOL up to there."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.loader import hf_model_config
from tests.exactness.matrix import LAYOUTS, Case, requests, serve
from tests.exactness.test_moe_disagg import differences
from tests.helpers import FAMILIES, save_tiny

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    kind, switches = FAMILIES["deepseek_v3"]
    return str(save_tiny(tmp_path_factory.mktemp("mla") / "deepseek_v3", kind, seed=9, **switches))


@pytest.fixture(scope="module")
def mla_reference(mla_model):
    return serve(Case(n3=False, structured=False), mla_model, batch_invariant=False)


@pytest.mark.parametrize("layout,tps", [("1P1D", (1, 1)), ("P2-D1", (2, 1)), ("P1-D2", (1, 2))])
def test_mla_disaggregated_equals_colocated(mla_model, mla_reference, layout, tps, request, monkeypatch):
    monkeypatch.setitem(LAYOUTS, layout, ("disaggregated", 1, 1, *tps))
    case = Case(layout=layout, n3=False, structured=False, concurrency=8)
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    assert differences(serve(case, mla_model, batch_invariant=False, counts=counts), mla_reference) == []
    cfg = hf_model_config(Path(mla_model))
    tokens = sum(len(prompt) for prompt, _ in requests(case).values())
    # every prompt token's entry, each layer, fp32: once, from one prefill rank, to decode rank 0
    assert counts["kv_bytes_received"] == tokens * cfg.num_layers * cfg.mla.entry_size * 4
