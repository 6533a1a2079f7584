"""DeepSeek's latent attention served disaggregated equals colocated: 1P1D, a prefill of two TP
ranks feeding a decode of one, and one feeding two. Each decode rank receives every token's
latent entry once, whatever the TP sizes (the entry is not split by heads: every rank holds it).

Not in the batch-invariant mode (MLA does not run in it): as for the mixtures
(tests/exactness/test_moe_disagg.py), outputs equal up to a first differing token that must be a
near-tie of the reference's, logprobs within LOGPROB_TOL up to there. DeepSeek-V3's MTP module
drafting on a decode of two TP ranks keeps that."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.control.cluster import Cluster
from engine.loading.loader import hf_model_config
from kvtransfer.nixl_agent import nixl_unavailable
from tests.engine.speculative.test_mtp import write_mtp_checkpoint
from tests.exactness.matrix import LAYOUTS, Case, requests, serve, spec_of
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


@pytest.mark.parametrize("layout,tps,transport", [("1P1D", (1, 1), "torch"), ("P2-D1", (2, 1), "torch"),
                                                  ("P1-D2", (1, 2), "torch"), ("P1-D2", (1, 2), "nixl")])
def test_mla_disaggregated_equals_colocated(mla_model, mla_reference, layout, tps, transport, request, monkeypatch):
    """nixl: every decode rank reads the whole latent of the prefill rank's blocks."""
    if transport == "nixl" and nixl_unavailable() is not None:
        pytest.skip(nixl_unavailable())
    monkeypatch.setitem(LAYOUTS, layout, ("disaggregated", 1, 1, *tps))
    case = Case(layout=layout, n3=False, structured=False, concurrency=8, transport=transport)
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    assert differences(serve(case, mla_model, batch_invariant=False, counts=counts), mla_reference) == []
    cfg = hf_model_config(Path(mla_model))
    tokens = sum(len(prompt) for prompt, _ in requests(case).values())
    # every prompt token's entry, each layer, fp32: once, from one prefill rank, to decode rank 0 (nixl reads
    # whole blocks straight into the decode's: a prompt's last block's slots past it come too)
    want = tokens * cfg.num_layers * cfg.mla.entry_size * 4
    assert counts["kv_bytes_received"] == want if transport == "torch" else counts["kv_bytes_received"] >= want


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("mla") / "deepseek_v3_mtp"
    write_mtp_checkpoint(folder, seed=9)
    return str(folder)


def test_mtp_on_a_decode_of_two_ranks_equals_colocated(mtp_model, request, monkeypatch):
    """The checkpoint's MTP module drafts on decode rank 0; the output is colocated plain decoding's,
    and drafts were proposed. The batch limit is given: measured at load, it depends on the host's
    load (for this tiny model, measured idle: decode 5.5 ms, verify 8.2 ms and the module's two drafts
    4.4 ms at batch 1, limit 4), a busy host can measure speculation off at every size, and then no
    draft is proposed in this short run. The ranks profiling in step is
    tests/exactness/test_spec_disagg.py's P1-D3 cases'."""
    want = serve(Case(n3=False, structured=False), mtp_model, batch_invariant=False)
    monkeypatch.setitem(LAYOUTS, "P1-D2", ("disaggregated", 1, 1, 1, 2))
    case = Case(layout="P1-D2", n3=False, structured=False, concurrency=8)
    request.getfixturevalue("ray_session")
    knobs = dict(speculative_method="mtp", num_speculative_tokens=2, speculative_max_batch_size=16)
    with Cluster(spec_of(case, mtp_model, batch_invariant=False, **knobs), use_ray=True) as cluster:
        assert differences(serve(case, mtp_model, cluster=cluster), want) == []
        loads = [i.client.load() for i in cluster.instances.values() if i.role == "decode"]
    assert sum(v for load in loads for k, v in load.items() if k.startswith("spec_proposed/mtp/")) > 0, loads
    assert sum(load["spec_rows_received"] for load in loads) > 0, loads  # the prompts' hidden states, shipped
