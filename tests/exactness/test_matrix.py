"""Disaggregated equals colocated, bit for bit, over a pairwise design of the serving factors
(tests/exactness/matrix.py), in the batch-invariant mode."""
from __future__ import annotations

import pytest

from cluster.control.cluster import Cluster
from kvtransfer.nixl_agent import nixl_unavailable
from tests.exactness.matrix import Case, mismatches, pairwise_cases, reference, serve, spec_of
from tests.kvtransfer.faults import corrupt_in_flight, without_payload_macs

pytestmark = pytest.mark.timeout(300)
CASES = pairwise_cases()


@pytest.fixture(scope="module")
def references(model):
    """The reference outputs per KV dtype, served once."""
    return {kv: serve(reference(kv), model) for kv in ("auto", "fp8_e4m3")}


def test_the_design_covers_every_pair():
    """Every two factors' values meet in some case, and the design is smaller than the product."""
    from itertools import combinations
    from tests.exactness.matrix import FACTORS
    names = list(FACTORS)
    for a, b in combinations(names, 2):
        met = {(getattr(c, a), getattr(c, b)) for c in CASES}
        assert met == {(x, y) for x in FACTORS[a] for y in FACTORS[b]}, (a, b)
    assert len(CASES) < 32


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_equals_colocated(case: Case, model, references, request):
    if case.transport == "nixl" and nixl_unavailable() is not None:
        pytest.skip(nixl_unavailable())
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    assert mismatches(serve(case, model, counts=counts), references[case.kv_dtype]) == []
    # how often the small pool preempted depends on how the requests interleave (none, one at a
    # time); tests/engine/quant/test_batch_invariant.py forces preemptions and checks them bit for bit
    request.node.user_properties.append(("preemptions", counts["preemptions"]))


CONTROL = Case(layout="1P1D", n3=False, structured=False)  # one request at a time: the first part is p0's


def test_one_corrupted_element_is_reported(model, references):
    """The negative control: one element of one layer's K altered on the wire (tests/kvtransfer/
    faults.py), payload MACs off (they would catch it), nothing else changed; the matrix reports
    that request as a mismatch."""
    cluster = Cluster(spec_of(CONTROL, model), use_ray=False).start()
    try:
        without_payload_macs(cluster)
        with corrupt_in_flight(layer=1, times=1) as fault:
            got = serve(CONTROL, model, cluster=cluster)
    finally:
        cluster.shutdown()
    assert len(fault.altered) == 1
    found = mismatches(got, references["auto"])
    assert len(found) == 1 and found[0].startswith("p0[0]: "), found


def test_kv_checksums_catch_it_and_the_retry_is_exact(model, references):
    """The same corruption with --kv-checksum: detected on receipt, the request retried, every
    output equal to the reference bit for bit, the mismatch counted on the decode instance."""
    counts = {}
    with corrupt_in_flight(layer=1, times=1) as fault:
        cluster = Cluster(spec_of(CONTROL, model, kv_checksum=True), use_ray=False).start()
        try:
            got = serve(CONTROL, model, cluster=cluster)
            counts = cluster.instances["decode-0"].client.load()
            retried = cluster.router.stats["retries"] + cluster.router.stats["kv_recomputes"]
        finally:
            cluster.shutdown()
    assert len(fault.altered) == 1
    assert mismatches(got, references["auto"]) == []
    assert counts["kv_checksum_mismatches"] == 1 and retried >= 1, (counts, retried)
